"""The backward moment a plan peaks at, recomputed from the moments it lists (shared by the tests that
compare it with real DeepSpeed's peak)."""

from __future__ import annotations

from zeroplan.core.backward_moments import activation_at


def winner(plan):
    """The largest of ``plan.memory.backward_moments``, checked to be the backward phase's peak."""
    m = plan.memory
    grads_fwd = m.phases["forward"].by_category["gradients"]  # stage 3's partition lives through the forward
    live = [m.params + m.optimizer_states + mo.buffers + max(grads_fwd, mo.gradients) + mo.autograd
            + activation_at(m.activations_detail, mo.activations, mo.layers_done) for mo in m.backward_moments]
    assert max(live) == m.phases["backward"].peak
    return m.backward_moments[live.index(max(live))]
