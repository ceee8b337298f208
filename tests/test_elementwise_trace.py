"""The unfused element-wise byte counts (core/elementwise.py, ``--kernels unfused`` / ``unfused-amp``)
against the ATen kernels transformers' own GPT-2 and Llama run, forward and backward, traced on CPU.

Every kernel is counted as the bytes it reads plus the bytes it writes, each tensor once (a broadcast
dimension once); views and outputs aliasing an input move nothing. Matmul-class kernels, the fused SDPA
kernel and kernels touching the score matrix (last two dims s × s: compute.eager_score_bytes) are left
out. What CUDA runs differently from CPU is emulated:
- ``F.dropout`` as ``aten::native_dropout`` (CPU splits it into bernoulli_/div_/mul);
- ``torch.autocast("cuda")`` as a TorchFunctionMode applying CUDA's op lists (ATen/autocast_mode.h);
- ``F.scaled_dot_product_attention`` as one opaque kernel with flash's layouts (output allocated
  (B, S, H, D), gradients ``empty_like(x.transpose(1, 2))``).
Per layer = (4-layer model − 2-layer model) / 2, per token; zeroplan's count must equal it exactly.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from aten_trace import aliases_an_input as _aliases_an_input  # noqa: E402

from zeroplan.core import elementwise  # noqa: E402
from zeroplan.specs.model import spec_from_config  # noqa: E402
from zeroplan.specs.training import TrainingSetup, get_precision  # noqa: E402

B, S, V = 3, 40, 1000  # S differs from head_dim (64), so score tensors (..., S, S) are told apart
T = B * S
LOWP = (torch.float16, torch.bfloat16)
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "mv", "addmv"}
NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "lift_fresh_copy", "_local_scalar_dense", "set_", "resize_", "detach", "alias"}
SHAPE_ONLY = {"nll_loss_forward": {"self"}, "nll_loss_backward": {"self"}, "zeros_like": {"self"},
              "ones_like": {"self"}, "full_like": {"self"}, "new_zeros": {"self"}, "new_ones": {"self"}}
WRITE_ONLY_SELF = {"zero_", "fill_", "copy_", "bernoulli_", "uniform_", "normal_", "random_"}


def _footprint(t) -> int:
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _classify(t) -> str:
    shp = tuple(t.shape)
    if t.numel() <= 1:
        return "scalar"
    if len(shp) >= 2 and shp[-2:] == (S, S):
        return "score"
    if t.numel() % T == 0:
        return "logits" if V in shp else "act"
    return "pos" if S in shp else "param"



class _Counter(TorchDispatchMode):
    """bytes[(phase, class)] of every counted kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.paused = "fwd", False
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if self.paused or func.is_view or name in NO_TRAFFIC:
            return out
        mutable = func._schema.is_mutable
        if not mutable and _aliases_an_input(out, (args, kwargs)):
            return out
        written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        moved = []
        for i, a in enumerate(func._schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in tree_leaves(v):
                if not isinstance(t, torch.Tensor) or a.name in SHAPE_ONLY.get(name, ()):
                    continue
                if name == "embedding" and a.name == "weight":
                    moved.append(out)  # a lookup reads the rows it gathers
                    continue
                moved.append(t)
                if a.name in written and not (a.name == "self" and name in WRITE_ONLY_SELF):
                    moved.append(t)  # read and written
        if not mutable:
            moved += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        classes = [_classify(t) for t in moved]
        base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
        if base in MATMUL or name.startswith("_scaled_dot_product") or "score" in classes:
            return out
        for t, c in zip(moved, classes):
            self.bytes[(self.phase, c)] += _footprint(t)
        return out


_ACTIVE: list[_Counter] = []


@contextlib.contextmanager
def _paused():
    c = _ACTIVE[-1] if _ACTIVE else None
    if c is not None:
        c.paused = True
    try:
        yield
    finally:
        if c is not None:
            c.paused = False


class _CudaAutocast(TorchFunctionMode):
    """torch.autocast('cuda', dtype) for the ops these models call (ATen/autocast_mode.h): matmuls and
    SDPA in half; pow, rsqrt, exp, log, layer_norm, rms_norm, nll_loss in fp32; softmax, log_softmax and
    sum in fp32 when given half without a dtype. fp32 leaf weights are cast once per forward (cached)."""

    LOW = {torch.addmm, torch.mm, torch.bmm, torch.baddbmm, torch.matmul, torch.Tensor.matmul,
           torch.Tensor.__matmul__, F.linear, torch.einsum, F.scaled_dot_product_attention}
    FP32 = {torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.rsqrt, torch.Tensor.rsqrt, torch.exp,
            torch.Tensor.exp, torch.log, torch.Tensor.log, torch.reciprocal, torch.Tensor.reciprocal,
            F.softplus, F.layer_norm, torch.layer_norm, F.rms_norm, F.nll_loss}
    SET_OPT = {F.softmax: torch.softmax, torch.softmax: torch.softmax, torch.Tensor.softmax: torch.softmax,
               F.log_softmax: torch.log_softmax, torch.log_softmax: torch.log_softmax,
               torch.Tensor.log_softmax: torch.log_softmax}

    def __init__(self, dtype) -> None:
        super().__init__()
        self.dtype, self.cache = dtype, {}

    def _cast(self, t, dtype):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (torch.float64, dtype)):
            return t
        if dtype in LOWP and t.dtype == torch.float32 and t.is_leaf and t.requires_grad:
            if id(t) not in self.cache:
                self.cache[id(t)] = t.to(dtype)
            return self.cache[id(t)]
        return t.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.LOW or func in self.FP32:
            dt = self.dtype if func in self.LOW else torch.float32
            if func is torch.einsum:
                args = [args[0]] + [self._cast(a, dt) for a in tree_leaves(list(args[1:]))]
            else:
                args = [self._cast(a, dt) for a in args]
            return func(*args, **{k: self._cast(v, dt) for k, v in kwargs.items()})
        if func in self.SET_OPT and args[0].dtype in LOWP and kwargs.get("dtype") is None:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return self.SET_OPT[func](args[0], dim, dtype=torch.float32)
        if func in (torch.sum, torch.Tensor.sum) and args[0].dtype in LOWP and kwargs.get("dtype") is None:
            return func(*args, **kwargs, dtype=torch.float32)
        if func is F.cross_entropy and args[0].dtype in LOWP:
            return F.nll_loss(torch.log_softmax(args[0], 1, dtype=torch.float32), args[1],
                              ignore_index=kwargs.get("ignore_index", -100), reduction=kwargs.get("reduction", "mean"))
        return func(*args, **kwargs)


class _CudaDropout(TorchFunctionMode):
    """F.dropout as CUDA runs it in training: aten::native_dropout (reads x, writes y and a 1-byte mask)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            return torch.native_dropout(args[0], p, True)[0] if training and 0 < p < 1 else args[0]
        return func(*args, **kwargs)


class _FlashSDPA(torch.autograd.Function):
    """SDPA as one fused kernel: nothing inside counted; outputs and input gradients in flash's layouts."""

    @staticmethod
    def forward(ctx, kwargs, *xs):
        with _paused(), torch.enable_grad():
            ins = [x.detach().requires_grad_(x.requires_grad) for x in xs]
            out = F.scaled_dot_product_attention(*ins, **kwargs)
        ctx.ins, ctx.out = ins, out
        r = torch.empty(out.shape[0], out.shape[2], out.shape[1], out.shape[3], dtype=out.dtype).transpose(1, 2)
        with _paused():
            r.copy_(out.detach())
        return r

    @staticmethod
    def backward(ctx, g):
        with _paused():
            grads = torch.autograd.grad(ctx.out, ctx.ins, g, allow_unused=True)
            res = []
            for x, gx in zip(ctx.ins, grads):
                r = torch.empty_like(x.transpose(1, 2)).transpose(1, 2)
                r.copy_(gx)
                res.append(r)
        return (None, *res)


class _FusedSDPA(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _FlashSDPA.apply(kwargs, *args[:3])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _cuda_like(amp_dtype, counter: _Counter):
    with contextlib.ExitStack() as st:
        st.enter_context(counter)
        _ACTIVE.append(counter)
        st.callback(_ACTIVE.pop)
        st.enter_context(_FusedSDPA())
        st.enter_context(_CudaDropout())
        if amp_dtype is not None:
            st.enter_context(_CudaAutocast(amp_dtype))
        yield


GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_head": 4, "n_positions": 64, "vocab_size": V, "n_inner": 1024,
        "activation_function": "gelu_new", "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": V, "hidden_act": "silu",
         "tie_word_embeddings": False}
LAYERS_KEY = {"gpt2": "n_layer", "llama": "num_hidden_layers"}
# (precision, kernels) -> the model's dtype and autocast's
MODES = {("bf16", "unfused"): (torch.bfloat16, None), ("fp32", "unfused"): (torch.float32, None),
         ("bf16", "unfused-amp"): (torch.float32, torch.bfloat16), ("fp16", "unfused-amp"): (torch.float32, torch.float16)}


def _model(cfg: dict, layers: int, attn: str, dtype):
    torch.manual_seed(0)
    cfg = dict(cfg, **{LAYERS_KEY[cfg["model_type"]]: layers}, use_cache=False)
    cls = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[cfg["model_type"]]
    conf = cls[0](**{k: v for k, v in cfg.items() if k != "model_type"})
    conf._attn_implementation = attn
    return cls[1](conf).train().to(dtype)


def _trace(cfg: dict, layers: int, attn: str, mode: tuple) -> _Counter:
    model = _model(cfg, layers, attn, mode[0])
    x = torch.randint(0, V, (B, S))
    c = _Counter()
    with _cuda_like(mode[1], c):
        loss = model(input_ids=x, labels=x).loss
    c.phase = "bwd"
    with _cuda_like(mode[1], c):
        loss.backward()
    return c


def _traced_layer(cfg: dict, attn: str, mode: tuple) -> tuple[float, float]:
    """(forward, backward) bytes per token of one decoder layer, rotary tables included."""
    two, four = _trace(cfg, 2, attn, mode), _trace(cfg, 4, attn, mode)
    d = {ph: sum(four.bytes[(ph, c)] - two.bytes[(ph, c)] for c in ("act", "pos")) / 2 / T for ph in ("fwd", "bwd")}
    return d["fwd"], d["bwd"]


def _zeroplan_layer(cfg: dict, attn: str, precision: str, kernels: str) -> tuple[float, float]:
    spec = spec_from_config(dict(cfg, **{LAYERS_KEY[cfg["model_type"]]: 2}), "tiny", "test")
    tr = TrainingSetup(precision=get_precision(precision), micro_batch=B, seq_len=S, kernels=kernels,
                       flash_attention=attn == "sdpa")
    key, _ = elementwise._mode(tr)
    return elementwise._layer_bytes(spec, tr, key)


CASES = [(name, attn, prec, kern) for name in ("gpt2", "llama") for attn in ("eager", "sdpa")
         for prec, kern in MODES]


@pytest.mark.parametrize("name,attn,precision,kernels", CASES)
def test_a_layers_unfused_traffic_is_what_transformers_runs(name, attn, precision, kernels):
    cfg = {"gpt2": GPT2, "llama": LLAMA}[name]
    traced = _traced_layer(cfg, attn, MODES[(precision, kernels)])
    ours = _zeroplan_layer(cfg, attn, precision, kernels)
    print(f"{name} {attn} {precision} {kernels}: traced {traced[0]:.1f} / {traced[1]:.1f}, "
          f"zeroplan {ours[0]:.1f} / {ours[1]:.1f} bytes per token and layer")
    assert ours == pytest.approx(traced, rel=1e-9)


@pytest.mark.parametrize("precision,kernels", list(MODES))
def test_the_loss_over_the_logits(precision, kernels):
    # transformers' ForCausalLMLoss: logits.float(), log_softmax, nll_loss; per vocabulary entry per token
    c = _trace(LLAMA, 2, "sdpa", MODES[(precision, kernels)])
    tr = TrainingSetup(precision=get_precision(precision), kernels=kernels)
    key, _ = elementwise._mode(tr)
    assert elementwise.UNFUSED[key]["logits"] == (c.bytes[("fwd", "logits")] / (T * V),
                                                  c.bytes[("bwd", "logits")] / (T * V))


def test_unfused_moves_several_times_the_fused_count():
    # the reason the option exists: transformers' GPT-2 (unfused tanh GELU) moves ~6x the fused count
    spec = spec_from_config(dict(GPT2, n_layer=12, n_embd=768, n_head=12, n_inner=3072), "gpt2-small", "test")
    fused = elementwise.elementwise_traffic(spec, TrainingSetup(precision=get_precision("bf16"), seq_len=1024))
    unfused = elementwise.elementwise_traffic(spec, TrainingSetup(precision=get_precision("bf16"), seq_len=1024,
                                                                  kernels="unfused"))
    ratio = (unfused.forward_bytes + unfused.backward_bytes) / (fused.forward_bytes + fused.backward_bytes)
    assert 5 < ratio < 12
