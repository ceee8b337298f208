"""The forward pass of ``runtime/model.py``'s module tree (split out of it): the holder modules grouped
by role into a static plan stored on the root, then embed, the layers (attention, MLP or MoE, norms,
sequential or parallel residual, optional full activation checkpointing), the final norm and the
lm head, and the causal-LM loss. Every holder is called as a module, so hooks see each use.
"""

from __future__ import annotations

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


def _mlp(lay: dict, x: Any, F: Any, gated: bool | None = None) -> Any:
    if "mlp_gate_up" in lay:
        gu = lay["mlp_gate_up"](x)
        g, u = gu.chunk(2, dim=-1)
        return lay["mlp_down"](F.silu(g) * u)
    if "mlp_gate" in lay:
        return lay["mlp_down"](F.silu(lay["mlp_gate"](x)) * lay["mlp_up"](x))
    return lay["mlp_down"](F.gelu(lay["mlp_up"](x)))


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
            ye = ex["expert_down"](F.silu(ex["expert_gate"](xe)) * ex["expert_up"](xe))
        else:
            ye = ex["expert_down"](F.gelu(ex["expert_up"](xe)))
        out = out.index_add(0, tok, ye * weights[tok, slot].unsqueeze(-1))
    return out.reshape(b, s, h)


def _attention(root: Any, lay: dict, x: Any, torch: Any, F: Any) -> Any:
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
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o.transpose(1, 2).reshape(b, s, -1)
    return lay["attn_o"](o)


def _forward(root: Any, torch: Any, F: Any, input_ids: Any) -> Any:
    pre = root.plan_pre
    x = pre["embed"](input_ids)
    if "pos" in pre:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = x + pre["pos"](pos).unsqueeze(0)
    if getattr(root, "checkpointing", "none") == "full":
        from torch.utils.checkpoint import checkpoint

        # as transformers 5.x: PreTrainedModel._activation_checkpointing_enable defaults to
        # {"use_reentrant": False} and GradientCheckpointingLayer checkpoints the layer's forward, so
        # the modules inside it are called again (their ZeRO-3 hooks fire) when backward recomputes it
        for lay in root.plan_layers:
            x = checkpoint(_layer, root, lay, x, torch, F, use_reentrant=False)
    else:
        for lay in root.plan_layers:
            x = _layer(root, lay, x, torch, F)
    for norm in root.plan_post_norms:
        x = norm(x)
    logits = root.plan_head(x)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           input_ids[:, 1:].reshape(-1))


def _layer(root: Any, lay: dict, x: Any, torch: Any, F: Any) -> Any:
    """One transformer block: x -> x + attention + MLP (parallel or sequential)."""
    norms = lay["norms"]
    mlp = (lambda h: _moe(root, lay, h, torch, F)) if lay["experts"] else (lambda h: _mlp(lay, h, F))
    if root.parallel:
        a_in = norms[0](x) if norms else x
        m_in = norms[1](x) if len(norms) > 1 else a_in
        x = x + _attention(root, lay, a_in, torch, F) + mlp(m_in)
    elif len(norms) >= 4:  # pre + post norms around both sub-layers (gemma2-style)
        x = x + norms[1](_attention(root, lay, norms[0](x), torch, F))
        x = x + norms[3](mlp(norms[2](x)))
    else:
        h = norms[0](x) if norms else x
        x = x + _attention(root, lay, h, torch, F)
        h = norms[1](x) if len(norms) > 1 else x
        x = x + mlp(h)
    return x
