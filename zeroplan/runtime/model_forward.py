"""The forward pass of ``runtime/model.py``'s module tree (split out of it): the holder modules grouped
by role into a static plan stored on the root, then embed, the layers (attention, MLP or MoE, norms,
sequential or parallel residual, optional full activation checkpointing), the final norm and the
lm head, and the causal-LM loss. Every holder is called as a module, so hooks see each use.
"""

from __future__ import annotations

import math
from typing import Any

from zeroplan.specs.model import ModelSpec


def _plan_forward(root: Any, spec: ModelSpec, order: list) -> None:
    """Group holder modules by role into a static execution plan (stored on the root)."""
    pre: dict[str, Any] = {}
    layers: dict[int, dict[str, Any]] = {}
    post_norms: list[Any] = []
    head = None
    for mname, holder, role in order:
        if holder.layer is None:
            if role == "embed":
                pre["embed"] = holder
            elif role == "pos_embed":
                pre["pos"] = holder
            elif role == "norm":
                if "embed" in pre and head is None:
                    post_norms.append(holder)
            elif role == "lm_head":
                head = holder
            else:
                raise ValueError(f"module {mname!r}: role {role!r} outside a layer is not supported")
            continue
        lay = layers.setdefault(holder.layer, {"norms": [], "qk_norms": [], "experts": {}})
        if role == "norm":
            shape = holder.weight.shape
            if shape[-1] == spec.head_dim and spec.head_dim != spec.hidden_size:
                lay["qk_norms"].append(holder)
            else:
                lay["norms"].append(holder)
        elif holder.expert is not None:
            lay["experts"].setdefault(holder.expert, {})[role] = holder
        else:
            if role in lay:
                raise ValueError(f"layer {holder.layer}: two modules with role {role!r}")
            lay[role] = holder
    if "embed" not in pre or head is None:
        raise ValueError(f"model {spec.name!r}: the runtime needs an 'embed' and an 'lm_head' tensor")
    root.plan_pre = pre
    root.plan_layers = [layers[k] for k in sorted(layers)]
    root.plan_post_norms = post_norms
    root.__dict__["plan_head"] = head  # not a submodule: the holder is registered under its own name


def _act(root: Any, x: Any, torch: Any, F: Any) -> Any:
    """The family's activation as transformers' ACT2FN computes it (transformers/activations.py): the
    fused kernels save their input only; ``gelu_new`` (NewGELUActivation) and ``gelu_fast``
    (FastGELUActivation) are written out in Python there, so autograd keeps each intermediate."""
    name = root.hidden_act
    if name == "silu":
        return F.silu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if name == "gelu_fast":
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    return F.gelu(x)


def _mlp(root: Any, lay: dict, x: Any, torch: Any, F: Any) -> Any:
    if "mlp_gate_up" in lay:
        gu = lay["mlp_gate_up"](x)
        g, u = gu.chunk(2, dim=-1)
        return lay["mlp_down"](u * _act(root, g, torch, F))  # Phi3MLP: up_states * act(gate)
    if "mlp_gate" in lay:
        return lay["mlp_down"](_act(root, lay["mlp_gate"](x), torch, F) * lay["mlp_up"](x))
    return lay["mlp_down"](_act(root, lay["mlp_up"](x), torch, F))


def _moe(root: Any, lay: dict, x: Any, torch: Any, F: Any) -> Any:
    b, s, h = x.shape
    flat = x.reshape(b * s, h)
    logits = lay["router"](flat)
    probs = F.softmax(logits.float(), dim=-1)
    k = min(root.experts_per_token, probs.shape[-1])
    weights, chosen = torch.topk(probs, k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(flat)
    for e in sorted(lay["experts"]):
        ex = lay["experts"][e]
        tok, slot = (chosen == e).nonzero(as_tuple=True)
        xe = flat.index_select(0, tok)
        if "expert_gate" in ex:
            ye = ex["expert_down"](_act(root, ex["expert_gate"](xe), torch, F) * ex["expert_up"](xe))
        else:
            ye = ex["expert_down"](_act(root, ex["expert_up"](xe), torch, F))
        out = out.index_add(0, tok, ye * weights[tok, slot].unsqueeze(-1))
    return out.reshape(b, s, h)


def _rope_tables(root: Any, positions: Any, dtype: Any, torch: Any) -> tuple[Any, Any] | None:
    """cos and sin of the rotary embedding, once per forward and shared by the layers, as transformers'
    LlamaRotaryEmbedding.forward makes them: fp32 inverse frequencies times the positions, the angles
    repeated to the rotary width, cos/sin cast to the activation dtype. None for a model without rotary
    embeddings (gpt2). They carry no parameter; they are here because autograd keeps them."""
    rot = root.rotary_dims
    if not rot:
        return None
    inv_freq = 1.0 / (root.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64, device=positions.device)
                                          .float() / rot))
    freqs = (inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1) @ positions[:, None, :].float())
    emb = torch.cat((freqs.transpose(1, 2),) * 2, dim=-1)
    scaling = 1.0  # transformers multiplies by attention_scaling (1.0 without rope scaling): a copy each
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate(t: Any, cos: Any, sin: Any, rot: int, torch: Any) -> Any:
    """apply_rotary_pos_emb on one of q, k (batch, heads, seq, head_dim): the first ``rot`` dims rotated
    (x·cos + rotate_half(x)·sin), the rest passed through (partial rotary: phi, gpt_neox)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    t_rot, t_pass = (t, None) if rot == t.shape[-1] else (t[..., :rot], t[..., rot:])
    half = t_rot.shape[-1] // 2
    out = t_rot * cos + torch.cat((-t_rot[..., half:], t_rot[..., :half]), dim=-1) * sin
    return out if t_pass is None else torch.cat((out, t_pass), dim=-1)


def _attention(root: Any, lay: dict, x: Any, rope: Any, torch: Any, F: Any) -> Any:
    b, s, _ = x.shape
    hd, nh, nkv = root.head_dim, root.n_heads, root.n_kv
    if "attn_qkv" in lay:
        qkv = lay["attn_qkv"](x)
        width = qkv.shape[-1]
        if width == (nh + 2 * nkv) * hd:
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        else:
            q, k, v = qkv.chunk(3, dim=-1)
            nh = nkv = q.shape[-1] // hd
    else:
        q, k, v = lay["attn_q"](x), lay["attn_k"](x), lay["attn_v"](x)
    q = q.reshape(b, s, -1, hd).transpose(1, 2)
    k = k.reshape(b, s, -1, hd).transpose(1, 2)
    v = v.reshape(b, s, -1, hd).transpose(1, 2)
    if lay["qk_norms"]:
        q = lay["qk_norms"][0](q)
        if len(lay["qk_norms"]) > 1:
            k = lay["qk_norms"][1](k)
    if rope is not None:
        q, k = (_rotate(t, *rope, root.rotary_dims, torch) for t in (q, k))
    # grouped-query heads: transformers' sdpa_attention_forward passes enable_gqa (use_gqa_in_sdpa: no
    # mask, head dim <= 256) instead of repeating k and v, so SDPA keeps them at their own width
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    o = o.transpose(1, 2).reshape(b, s, -1)
    return lay["attn_o"](o)


def _forward(root: Any, torch: Any, F: Any, input_ids: Any) -> Any:
    x = _decoder(root, torch, F, input_ids)
    logits = root.plan_head(x)
    # as transformers' ForCausalLMLoss: the whole logits upcast once (no 16-bit copy of a shifted slice),
    # the labels shifted instead, the last position ignored (-100), mean over the rest
    labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def _decoder(root: Any, torch: Any, F: Any, input_ids: Any) -> Any:
    """Embeddings, the layers and the final norm, as the base model's forward (LlamaModel.forward): its
    locals, the embedding output and the positions, stay alive until it returns, through every layer."""
    pre = root.plan_pre
    embeds = pre["embed"](input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    x = embeds + pre["pos"](positions) if "pos" in pre else embeds
    rope = _rope_tables(root, positions, x.dtype, torch)
    if getattr(root, "checkpointing", "none") == "full":
        from torch.utils.checkpoint import checkpoint

        # as transformers 5.x: PreTrainedModel._activation_checkpointing_enable defaults to
        # {"use_reentrant": False} and GradientCheckpointingLayer checkpoints the layer's forward, so
        # the modules inside it are called again (their ZeRO-3 hooks fire) when backward recomputes it
        for lay in root.plan_layers:
            x = checkpoint(_layer, root, lay, x, rope, torch, F, use_reentrant=False)
    else:
        for lay in root.plan_layers:
            x = _layer(root, lay, x, rope, torch, F)
    for norm in root.plan_post_norms:
        x = norm(x)
    return x


def _layer(root: Any, lay: dict, x: Any, rope: Any, torch: Any, F: Any) -> Any:
    """One transformer block: x -> x + attention + MLP (parallel or sequential)."""
    norms = lay["norms"]
    mlp = (lambda h: _moe(root, lay, h, torch, F)) if lay["experts"] else (lambda h: _mlp(root, lay, h, torch, F))
    if root.parallel:
        a_in = norms[0](x) if norms else x
        m_in = norms[1](x) if len(norms) > 1 else a_in
        x = x + _attention(root, lay, a_in, rope, torch, F) + mlp(m_in)
    elif len(norms) >= 4:  # pre + post norms around both sub-layers (gemma2-style)
        x = x + norms[1](_attention(root, lay, norms[0](x), rope, torch, F))
        x = x + norms[3](mlp(norms[2](x)))
    else:
        h = norms[0](x) if norms else x
        x = x + _attention(root, lay, h, rope, torch, F)
        h = norms[1](x) if len(norms) > 1 else x
        x = x + mlp(h)
    return x
