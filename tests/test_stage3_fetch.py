"""core/stage3_fetch.py on a three-module tied model, against schedules worked out by hand from
DeepSpeed 0.19.8's coordinator (partitioned_param_coordinator.py); no DeepSpeed needed.

The model: an embedding owning W (10 elements), a linear owning A (5), a head reading W (tied).
N = 1, so padded = numel. DeepSpeed's trace: model, embed, linear, head (forward; step ids 0-3),
model, head, linear, embed (backward; 4-7). The embedding's input is token ids: no post-backward
release for it (released as a leftover at the end of backward).
"""

from __future__ import annotations

from collections import Counter

from zeroplan.core.layout import zero_layout
from zeroplan.core.stage3_fetch import FetchUnit, stage3_gathers
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model

W, A = 0, 1
NUMEL = [10, 5]
UNITS = [FetchUnit("embed", (W,), grad_input=False), FetchUnit("linear", (A,)), FetchUnit("head", (W,))]
E9 = 10**9


def _calls(max_live, prefetch, reuse, persistent=(False, False), gas=1):
    got = stage3_gathers(NUMEL, NUMEL, list(persistent), UNITS, max_live=max_live, prefetch_bucket=prefetch,
                         max_reuse=reuse, grad_accum=gas)
    return [(g.phase, g.elements, count) for g, count in got]


def test_no_prefetch_no_reuse_gathers_the_tied_weight_for_each_reader():
    # every fetch gathers what is missing, every release frees it: W for embed and again for the
    # head in forward; in backward the head (first) gathers W, frees it after its backward, and
    # the embedding (last) gathers it again
    fwd = [("forward", 10, 1), ("forward", 5, 1), ("forward", 10, 1)]
    bwd = [("backward", 10, 1), ("backward", 5, 1), ("backward", 10, 1)]
    assert _calls(0, 0, 0) == fwd + bwd
    assert _calls(E9, 0, 0) == fwd + bwd  # max_live only bounds a prefetch; there is none


def test_reuse_window_keeps_what_is_read_again():
    # reuse 1e9: after the embedding's forward, W is read again within the window (the head): kept;
    # A is read again in backward: kept; nothing is gathered twice
    assert _calls(0, 0, E9) == [("forward", 10, 1), ("forward", 5, 1)]
    # reuse 5: at the embedding's release (step id 2) the window is the linear only (5 elements
    # traversed >= 5 ends it): W released; at the linear's (3) the head: A released; at the head's
    # (4) the model and the head again in backward: W kept. Backward: the head finds W, frees it
    # after its backward (window: the linear), the linear and the embedding gather again
    assert _calls(0, 0, 5) == [("forward", 10, 1), ("forward", 5, 1), ("forward", 10, 1),
                               ("backward", 5, 1), ("backward", 10, 1)]


def test_prefetch_runs_into_the_backward_part_of_the_trace():
    # prefetch 6: the model's own fetch (step 0) prefetches W (10 >= 6 stops it); the embedding's
    # fetch prefetches A and pops the rest of the queue (W's and A's later entries are skipped,
    # AVAILABLE, but their step ids are recorded), so no release happens before each parameter's
    # last use: two forward calls, none in backward, whatever the reuse distance
    assert _calls(E9, 6, 0) == [("forward", 10, 1), ("forward", 5, 1)]
    # max_live 12: 2 elements of room after W: the embedding's fetch takes A (checked before
    # adding) and stops, so W's later entries are not popped and W is freed after the embedding;
    # the linear's fetch prefetches W again (room 7), the head's fetch A again (room 2); in
    # backward nothing fits at the model's fetch (room < 0), the head frees W, the linear's fetch
    # prefetches it for the embedding
    assert _calls(12, 6, 0) == [("forward", 10, 1), ("forward", 5, 1), ("forward", 10, 1), ("forward", 5, 1),
                                ("backward", 10, 1)]
    # max_live 10: no room after W: the linear gathers A itself and prefetches W for the head; the
    # backward repeats it from the model's own fetch
    assert _calls(10, 6, 0) == [("forward", 10, 1), ("forward", 5, 1), ("forward", 10, 1),
                                ("backward", 10, 1), ("backward", 5, 1), ("backward", 10, 1)]


def test_persistent_parameters_are_never_gathered_in_a_pass():
    assert _calls(0, 0, 0, persistent=(True, False)) == [("forward", 5, 1), ("backward", 5, 1)]
    assert _calls(0, 0, 0, persistent=(True, True)) == []


def test_micro_steps_repeat():
    def total(calls):
        out = Counter()
        for phase, elements, count in calls:
            out[(phase, elements)] += count
        return out

    for knobs in ((0, 0, 0), (12, 6, 0), (0, 0, 5)):
        assert total(_calls(*knobs, gas=4)) == Counter({k: 4 * v for k, v in total(_calls(*knobs)).items()})


def test_layout_units_give_the_tied_head_the_embeddings_tensor():
    spec = load_model("gpt2").scaled(num_layers=1, hidden_size=48, vocab_size=301, num_attention_heads=3)
    lay = zero_layout(spec, 2, ZeroConfig(stage=3))
    head = next(t for t in spec.tensors if t.tied_to)
    unit = next(u for u in lay.units if u.name == head.module)
    assert [lay.tensors[i].name for i in unit.params] == [head.tied_to]
    embeds = [u for u in lay.units if not u.grad_input]
    assert {u.name for u in embeds} == {t.module for t in spec.tensors if t.role in ("embed", "pos_embed")}
    # every tensor is read by its owner's unit; the head reads one more (the tie)
    assert sum(len(u.params) for u in lay.units) == len(lay.tensors) + 1


def _brute_force(numel, persistent, units, *, max_live, prefetch, reuse, gas, recompute=False):
    """Every micro-step of the warm-up and the measured step replayed, no repetition shortcut:
    {(phase, elements, params, prefetch): calls} of the measured step."""
    from zeroplan.core.stage3_fetch import _Coordinator, micro_step_events

    c = _Coordinator(list(numel), list(numel), list(persistent), micro_step_events(list(units), recompute),
                     list(units), max_live, prefetch, reuse)
    for _ in range(2):  # the warm-up step, then the measured one
        c.boundary()
        c.gathers = []
        for _ in range(gas):
            c.micro_step()
    return Counter((g.phase, g.elements, g.params, g.prefetch) for g in c.gathers)


def test_every_accumulation_equals_replaying_each_micro_step():
    """``stage3_gathers`` replays until a micro-step repeats its predecessor and counts the rest, and
    serves every accumulation past that point from one 16-micro-step replay (``recommend`` plans many
    grad_accum values): both shortcuts against replaying every micro-step of both steps."""
    from zeroplan.core import stage3_fetch

    spec = load_model("gpt2").scaled(num_layers=2, hidden_size=48, vocab_size=301, num_attention_heads=3)
    lay = zero_layout(spec, 1, ZeroConfig(stage=3, param_persistence_threshold=0))
    numel = [t.numel for t in lay.tensors]
    persistent = [False] * len(numel)

    def planned(gas, **kw):
        got: Counter = Counter()
        for g, count in stage3_gathers(numel, numel, persistent, lay.units, grad_accum=gas, **kw):
            got[(g.phase, g.elements, g.params, g.prefetch)] += count
        return got

    for max_live, prefetch, reuse in ((E9, 3000, 0), (E9, 3000, 20000), (12000, 3000, 5000), (0, 0, E9), (0, 0, 0)):
        for recompute in (False, True):
            kw = {"max_live": max_live, "prefetch_bucket": prefetch, "max_reuse": reuse, "recompute_layers": recompute}
            stage3_fetch._replayed.cache_clear()
            for gas in (1, 2, 3, 4, 7, 17, 20):
                want = _brute_force(numel, persistent, lay.units, max_live=max_live, prefetch=prefetch,
                                    reuse=reuse, gas=gas, recompute=recompute)
                assert planned(gas, **kw) == want, (max_live, prefetch, reuse, recompute, gas)
            # one replay each for grad_accum 1 and 2, one steady replay for all the others
            assert stage3_fetch._replayed.cache_info().misses == 3


def test_replays_are_shared_by_layouts_of_the_same_model():
    """Each plan builds its own Layout (evaluate, check, recommend's alternatives): the replays are
    cached by content, so a second layout of the same model reuses them; another model does not."""
    from zeroplan.core.comm import _replayed_calls
    from zeroplan.core.stage3_live import backward_gathered, replay_inputs

    zero = ZeroConfig(stage=3)
    spec = load_model("gpt2").scaled(num_layers=2, hidden_size=48, vocab_size=301, num_attention_heads=3)
    one, two = zero_layout(spec, 2, zero), zero_layout(spec, 2, zero)
    other = zero_layout(spec.scaled(num_layers=3), 2, zero)
    assert one is not two and replay_inputs(one, one, frozenset()) == replay_inputs(two, two, frozenset())
    assert hash(replay_inputs(one, one, frozenset())) == hash(replay_inputs(two, two, frozenset()))
    assert replay_inputs(other, other, frozenset()) != replay_inputs(one, one, frozenset())
    kw = {"max_live": E9, "prefetch_bucket": 50_000_000, "max_reuse": E9, "grad_accum": 1, "recompute_layers": False}
    assert backward_gathered(one, one, frozenset(), **kw) is backward_gathered(two, two, frozenset(), **kw)
    assert _replayed_calls(one, one, zero, 1, False, frozenset()) is _replayed_calls(two, two, zero, 1, False,
                                                                                       frozenset())
    assert backward_gathered(other, other, frozenset(), **kw) != backward_gathered(one, one, frozenset(), **kw)


def test_a_coalesced_prefetchs_flat_buffer_lives_until_its_last_parameter_is_fetched():
    """partition_parameters.py ``AllGatherCoalescedHandle``: the first wait copies every parameter out, the
    handle keeps the flat buffer while ``__inflight_param_registry`` still holds it for a parameter not yet
    fetched (core/stage3_fetch.py ``_Coordinator._waited``)."""
    from zeroplan.core.stage3_fetch import _Coordinator, micro_step_events

    units = [FetchUnit("a", (0,)), FetchUnit("b", (1,)), FetchUnit("c", (2,))]
    c = _Coordinator([10, 10, 10], [10, 10, 10], [False] * 3, micro_step_events(units), units, E9, E9, 0)
    seen: list[tuple[str, str, int, int]] = []
    c.boundary()
    c.micro_step(lambda kind, u, phase: seen.append((kind, "root" if u < 0 else units[u].name, c.live, c.flat)))
    flat = [(kind, name, f) for kind, name, _, f in seen[:8]]
    # the root's fetch prefetches a, b and c in one call (30 elements in flight); a's fetch waits on it: all three
    # copied out, the flat buffer kept beside them until c, its last parameter, is fetched
    assert seen[0] == ("fetch", "root", 30, 0) and seen[1] == ("fetch", "a", 30, 30)
    assert flat[2:7] == [("release", "a", 30), ("fetch", "b", 30), ("release", "b", 30), ("fetch", "c", 30),
                         ("release", "c", 0)]
