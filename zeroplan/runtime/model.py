"""Build a trainable torch module whose parameters are exactly ``ModelSpec.tensors``.

``build_model(spec, dtype, device)`` returns a module tree with one small "holder" module per
owning module of the spec (``ParamTensor.module``), parameters named and shaped exactly as in
the spec (tied tensors share one ``Parameter``), and a real ``forward(input_ids) -> loss``
(causal-LM cross-entropy, mean over tokens) that uses every parameter by its role:

- embed (+ pos_embed), per layer: norm(s), attention (separate q/k/v or fused qkv split as
  [q | k | v]; rotary embeddings on q and k; grouped-query heads through SDPA's ``enable_gqa``;
  causal ``scaled_dot_product_attention``), o-proj, MLP (gated or not, fused gate_up, the family's
  activation), MoE (router softmax + top-k experts), residual — parallel (attention and MLP both read
  the block input) for gpt_neox / falcon / phi / gptj, else sequential — then the final norm, the lm
  head and transformers' causal-LM loss.
- It exists to move the right bytes (parameters, gradients, and the activations autograd keeps), not
  to reproduce a checkpoint's outputs. Where transformers' code decides what autograd keeps, the
  forward is written the same way: LlamaRMSNorm's one fp32 copy of its input, GemmaRMSNorm's fp32
  product, rotary cos/sin made once per forward, ForCausalLMLoss's single upcast of the logits, the
  base model's embedding output alive through the layers. For llama, mistral and qwen2 it keeps the
  bytes of the planner's transformers trace exactly (tests/test_bundled_activations.py). Norms are
  LayerNorm when the norm owns a bias or the family uses LayerNorm (gpt2, gpt_neox, falcon, phi),
  RMSNorm otherwise.
- Every holder module is *called* (``module(x)``), so forward pre/post hooks see every module
  in forward order (the ZeRO-3 engine gathers parameters from those hooks). An MoE expert
  that receives no token is still called on an empty batch, so it is gathered and gets a
  (zero) gradient like in a dense pass. So each expert matrix is a module of its own, as the
  checkpoint names it, not transformers 5's fused experts module: the planner is given this tree as
  ``ModelSpec.module_tree = "checkpoint"`` (bench/zero_predict.py ``scaled_spec``, core/moe_leaf.py).

The forward pass itself (the static plan by role, attention, MLP, MoE, the layer loop) is
``runtime/model_forward.py``. Conventions: shapes are element counts; ``numel`` sums are parameters (elements), not bytes.
Initialisation is deterministic for a seed: weights N(0, 0.02), norm weights 1 (gemma's 0), biases 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroplan.runtime.model_forward import _forward, _plan_forward
from zeroplan.specs.model import ModelSpec, ParamTensor

if TYPE_CHECKING:
    import torch

__all__ = ["build_model", "ZeroModel", "param_units", "resolve_dtype", "LAYERNORM_FAMILIES", "PARALLEL_FAMILIES"]

LAYERNORM_FAMILIES = ("gpt2", "gpt_neox", "falcon", "phi", "gptj", "opt", "bloom")
PARALLEL_FAMILIES = ("gpt_neox", "falcon", "phi", "gptj")
_CONV1D_FAMILIES = ("gpt2",)  # HF Conv1D: weight [in, out]
_NO_ROTARY_FAMILIES = ("gpt2", "opt", "bloom")  # learned positions (gpt2, opt) or ALiBi (bloom)
# GemmaRMSNorm: the fp32 normalised input times (1 + weight) in fp32, then cast (the weight starts at 0)
_PLUS_ONE_NORM_FAMILIES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def _local_name(t: ParamTensor) -> str:
    prefix = t.module + "."
    if not t.name.startswith(prefix):
        raise ValueError(f"tensor {t.name!r} is not directly owned by module {t.module!r}")
    local = t.name[len(prefix):]
    if "." in local:
        raise ValueError(f"tensor {t.name!r}: expected '<module>.<param>', got nested name {local!r}")
    return local


def _make_classes():
    """Define the torch module classes lazily (torch is imported only on runtime paths)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class _Linear(torch.autograd.Function):
        """y = x·Wᵀ + b (``conv1d``: x·W + b) saving the Parameter itself, never a view of it.

        ZeRO-3 swaps ``param.data`` between a placeholder and the gathered tensor; autograd
        must find the re-gathered data at backward time, which holds for a saved leaf but not
        for a saved ``weight.t()`` view (it would keep the released buffer alive instead).
        """

        @staticmethod
        def forward(ctx, x, w, b, conv1d):  # type: ignore[override]
            ctx.save_for_backward(x, w)
            ctx.has_bias = b is not None
            ctx.conv1d = conv1d
            y = x @ w if conv1d else F.linear(x, w)
            return y + b if b is not None else y

        @staticmethod
        def backward(ctx, go):  # type: ignore[override]
            x, w = ctx.saved_tensors
            go2 = go.reshape(-1, go.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            need_x, need_w, need_b, _ = ctx.needs_input_grad  # a frozen weight (runtime/lora.py) gets none
            if ctx.conv1d:
                gx = go @ w.t() if need_x else None
                gw = x2.t() @ go2 if need_w else None
            else:
                gx = go @ w if need_x else None
                gw = go2.t() @ x2 if need_w else None
            gb = go2.sum(0) if ctx.has_bias and need_b else None
            return gx, gw, gb, None

    class Holder(nn.Module):
        """Owns the parameters of one spec module; ``forward`` applies them by ``kind``."""

        def __init__(self, kind: str, conv1d: bool = False, layernorm: bool = False, eps: float = 1e-5,
                     plus_one: bool = False):
            super().__init__()
            self.kind = kind
            self.conv1d = conv1d
            self.layernorm = layernorm
            self.eps = eps
            self.plus_one = plus_one

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if "base_layer" in self._modules:  # runtime/lora.py: peft's lora.Linear.forward
                y = self.base_layer(x)  # the frozen weight in its own module, as PEFT wraps it
                return y + self.lora_B["default"](self.lora_A["default"](x)) * self.lora_scaling
            k = self.kind
            w = self.weight
            b = getattr(self, "bias", None)
            if k in ("embed", "pos_embed"):
                return F.embedding(x, w)
            if k == "norm":
                if self.layernorm:
                    return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)
                # as transformers' LlamaRMSNorm.forward: ONE fp32 copy of the input, kept by both pow and
                # the multiply (casting twice would keep two), the fp32 rsqrt, the 16-bit normalised x
                xf = x.float()
                normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                if self.plus_one:  # GemmaRMSNorm.forward: the product in fp32 (it keeps the fp32 normalised x)
                    return (normed * (1.0 + w.float())).type_as(x)
                return w * normed.to(x.dtype)
            return _Linear.apply(x, w, b, self.conv1d)  # linear-like roles

    class TiedHead(nn.Module):
        """The lm head of a tied model: uses the embedding's Parameter (no parameter of its own).

        The shared Parameter is held in a plain attribute, so ``parameters()`` lists it once
        (owned by the embedding module), as DeepSpeed and ``ModelSpec.tensors`` count it.
        """

        def __init__(self, source: nn.Module):
            super().__init__()
            self.__dict__["_source"] = source  # not a submodule

        @property
        def weight(self) -> torch.Tensor:
            return self._source.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Linear.apply(x, self._source.weight, None, False)

    return torch, F, nn, Holder, TiedHead


def param_units(model: Any) -> list[tuple[str, Any, list[tuple[str, Any]]]]:
    """The gather units of a module tree, in forward order: (module name, module, [(param name, param)]).

    A unit is a module that directly owns parameters; a shared Parameter belongs to the first
    module that registers it. For a ``ZeroModel`` the order is the spec's tensor order.
    """
    if hasattr(model, "zero_units"):
        return model.zero_units
    seen: set[int] = set()
    units = []
    for mname, mod in model.named_modules():
        own = []
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            own.append((f"{mname}.{pname}" if mname else pname, p))
        if own:
            units.append((mname, mod, own))
    return units


def _output_requires_grad(module: Any, inputs: Any, output: Any) -> None:
    output.requires_grad_(True)


def build_model(spec: ModelSpec, dtype: Any = None, device: Any = "cpu", *, seed: int = 0,
                check_count: bool = True, checkpointing: str = "none") -> "ZeroModel":
    """A ``ZeroModel`` with parameters exactly ``spec.tensors`` (names, shapes, ties), on ``device``.

    ``dtype``: a torch dtype or "fp32"/"bf16"/"fp16". Raises ``ValueError`` when the spec has no
    tensors or (``check_count``, non-approximate specs) Σ numel != ``spec.params``.
    ``checkpointing``: "none" or "full" (every transformer layer recomputed in backward with
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; only the layer inputs are kept).
    """
    if checkpointing not in ("none", "full"):
        raise ValueError(f"checkpointing {checkpointing!r}: the runtime model implements none or full")
    torch, F, nn, Holder, TiedHead = _make_classes()
    dtype = resolve_dtype(torch, dtype)
    if not spec.tensors:
        raise ValueError(f"model spec {spec.name!r} has no parameter inventory (tensors) to build")

    class ZeroModelImpl(nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return _forward(self, torch, F, input_ids)

    root = ZeroModelImpl()
    _describe_root(root, spec, checkpointing)
    conv1d = spec.model_type in _CONV1D_FAMILIES
    layernorm_family = spec.model_type in LAYERNORM_FAMILIES
    eps = float(spec.hf_config.get("rms_norm_eps", spec.hf_config.get("layer_norm_epsilon",
                                   spec.hf_config.get("layer_norm_eps", 1e-5))))

    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    modules: dict[str, nn.Module] = {"": root}
    by_name: dict[str, Any] = {}
    holders: dict[str, Any] = {}
    order: list[tuple[str, Any, str]] = []  # (holder module name, holder, role) in first-use order

    def ensure(path: str) -> nn.Module:
        if path in modules:
            return modules[path]
        parent_path, _, leaf = path.rpartition(".")
        parent = ensure(parent_path)
        mod = nn.Module()
        parent.add_module(leaf, mod)
        modules[path] = mod
        return mod

    bias_names = {t.module for t in spec.tensors if t.name.endswith(".bias")}
    units: dict[str, list] = {}
    for t in spec.tensors:
        local = _local_name(t)
        if t.module in holders:
            holder = holders[t.module]
        else:
            parent_path, _, leaf = t.module.rpartition(".")
            if t.tied_to is not None:
                src_t = by_name.get(t.tied_to)
                if src_t is None:
                    raise ValueError(f"tensor {t.name!r} is tied to {t.tied_to!r}, which comes later or is missing")
                holder = TiedHead(holders[_owner_of(spec, t.tied_to)])
            else:
                holder = Holder(t.role, conv1d=conv1d and t.role not in ("embed", "pos_embed", "norm", "lm_head"),
                                layernorm=t.role == "norm" and (layernorm_family or t.module in bias_names), eps=eps,
                                plus_one=t.role == "norm" and spec.model_type in _PLUS_ONE_NORM_FAMILIES)
            parent = ensure(parent_path) if parent_path else root
            parent.add_module(leaf, holder)
            modules[t.module] = holder
            holders[t.module] = holder
            holder.spec_role = t.role if not t.name.endswith(".bias") else t.role
            holder.layer = t.layer
            holder.expert = t.expert
            order.append((t.module, holder, t.role))
        if t.tied_to is not None:
            by_name[t.name] = by_name[t.tied_to]
            continue
        p = nn.Parameter(_initial_values(torch, t, local, gen, holder.plus_one)
                         .to(device=device, dtype=dtype))
        holder.register_parameter(local, p)
        by_name[t.name] = p
        units.setdefault(t.module, []).append((t.name, p))

    root.zero_units = [(m, holders[m], ps) for m, ps in units.items()]
    root.zero_order = order
    root.zero_params = [(n, p) for _, _, ps in root.zero_units for n, p in ps]
    _plan_forward(root, spec, order)
    if checkpointing == "full" and "embed" in root.plan_pre:
        # as transformers 5.x: gradient_checkpointing_enable calls enable_input_require_grads, a forward
        # hook that makes the input embedding's output require a gradient, so under ZeRO-3 a frozen
        # base (LoRA) is fetched in backward from the first module on; registered before any engine's hooks
        root.plan_pre["embed"].register_forward_hook(_output_requires_grad)
    total = sum(p.numel() for p in root.parameters())
    if check_count and not spec.approximate and total != spec.params:
        raise ValueError(f"model {spec.name!r}: built {total} parameters, the spec says {spec.params}")
    return root


def _describe_root(root: Any, spec: ModelSpec, checkpointing: str) -> None:
    """The architecture facts the forward pass reads from the root module."""
    root.spec_name = spec.name
    root.checkpointing = checkpointing
    root.model_type = spec.model_type
    root.n_heads = spec.num_attention_heads
    root.n_kv = spec.num_key_value_heads or spec.num_attention_heads
    root.head_dim = spec.head_dim
    root.experts_per_token = spec.experts_per_token or 1
    root.parallel = spec.model_type in PARALLEL_FAMILIES
    cfg = spec.hf_config or {}
    # the activation transformers' ACT2FN picks for the family (gemma: hidden_activation, whose
    # default is gelu_pytorch_tanh; gpt2: activation_function; falcon: activation)
    if spec.model_type.startswith("gemma"):
        root.hidden_act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        root.hidden_act = cfg.get("hidden_act") or cfg.get("activation_function") or cfg.get("activation") or "gelu"
    # rotary embeddings (no parameters): every family here but gpt2; a partial factor (phi:
    # partial_rotary_factor, gpt_neox: rotary_pct) rotates that share of each head, as transformers does
    factor = float(cfg.get("partial_rotary_factor") or cfg.get("rotary_pct") or 1.0)
    no_rotary = spec.model_type in _NO_ROTARY_FAMILIES or bool(cfg.get("alibi"))
    # even: cos/sin repeat the rot/2 frequencies (a real checkpoint's rotary width always is; a tiny
    # test model's odd width keeps its last dimension unrotated)
    rot = int(spec.head_dim * factor)
    root.rotary_dims = 0 if no_rotary else rot - rot % 2
    root.rope_theta = float(cfg.get("rope_theta") or cfg.get("rotary_emb_base") or 10000.0)


def _initial_values(torch: Any, t: ParamTensor, local: str, gen: Any, plus_one: bool = False) -> Any:
    """fp32 initial values of tensor ``t``: biases 0, norm weights 1 (0 where the norm scales by 1 + weight,
    as GemmaRMSNorm), other weights N(0, 0.02)."""
    if local == "bias" or t.role == "norm" and local != "weight":
        return torch.zeros(t.shape, dtype=torch.float32) if local == "bias" else torch.ones(t.shape)
    if t.role == "norm":
        return (torch.zeros if plus_one else torch.ones)(t.shape, dtype=torch.float32)
    return torch.empty(t.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)


ZeroModel = Any  # the class is created lazily in build_model (torch-free import of this module)


def _owner_of(spec: ModelSpec, name: str) -> str:
    for t in spec.tensors:
        if t.name == name:
            return t.module
    raise ValueError(f"tied tensor {name!r} not found")


def resolve_dtype(torch: Any, dtype: Any) -> Any:
    """A torch dtype from a precision name (fp32/bf16/fp16, or float32/bfloat16/float16), a dtype, or None (fp32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
        if dtype not in table:
            raise ValueError(f"dtype {dtype!r}: expected fp32, bf16 or fp16")
        return table[dtype]
    return dtype
