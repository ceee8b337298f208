"""The eager-attention byte count (core/compute.py eager_score_bytes) against the ATen kernels that
transformers' eager_attention_forward really runs, forward and backward, traced on CPU.

Every kernel that reads or writes a tensor of the score matrix's size (batch × heads × s × s) is
logged with the bytes it reads and writes; views (outputs sharing an input's storage) move nothing and
are skipped. The mask, broadcast
over heads, is smaller and not counted (neither does the rule). The fp16 softmax with a fused upcast
exists on CUDA only, and CPU decomposes dropout differently from CUDA's native_dropout, so bf16 and
fp32 without dropout are what this machine can check.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from aten_trace import aliases_an_input as _aliases_an_input  # noqa: E402

from zeroplan.core.compute import eager_score_bytes  # noqa: E402
from zeroplan.specs.training import get_precision  # noqa: E402

B, HEADS, S, D = 1, 4, 32, 8
SCORES = B * HEADS * S * S



class _ScoreTraffic(TorchDispatchMode):
    """Sums the bytes of score-sized tensors every non-view kernel reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable or _aliases_an_input(out, (args, kwargs)):
            return out

        def score_bytes(tree) -> int:
            return sum(t.numel() * t.element_size() for t in tree_leaves(tree)
                       if isinstance(t, torch.Tensor) and t.numel() == SCORES)

        moved = score_bytes((args, kwargs)) + score_bytes(out)
        if moved:
            self.bytes += moved
            self.kernels.append(str(func))
        return out


class _Attention(torch.nn.Module):
    num_key_value_groups = 1


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_eager_score_bytes_match_the_traced_kernels(precision, dtype):
    q, k, v = (torch.randn(B, HEADS, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.triu(torch.full((S, S), float("-inf"), dtype=dtype), 1)[None, None]
    module = _Attention().train()
    trace = _ScoreTraffic()
    with trace:
        out, _ = llama.eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5, dropout=0.0)
        forward_bytes = trace.bytes
        out.float().sum().backward()
    fwd, bwd = eager_score_bytes(get_precision(precision), dropout=False)
    print(precision, trace.kernels)
    assert forward_bytes == fwd * SCORES
    assert trace.bytes - forward_bytes == bwd * SCORES
