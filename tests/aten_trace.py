"""What the ATen-trace tests share (test_eager_attention_trace.py, test_elementwise_trace.py)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


def aliases_an_input(out, inputs) -> bool:
    """True when every output shares storage with an input (views, and _unsafe_view, which is not tagged one):
    such a kernel moves no bytes."""
    ptrs = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(outs) and all(t.untyped_storage().data_ptr() in ptrs for t in outs)
