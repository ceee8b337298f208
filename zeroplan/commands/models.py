"""`zeroplan models list|show`: the bundled catalog and any model spec, with exact counts.

All counts are parameters (elements), never bytes. Imports no torch.
"""

from __future__ import annotations

from typing import Any

import typer

from zeroplan.commands._common import console, handle_errors, print_json

__all__ = ["register", "model_summary_dict", "list_rows"]

JSON_OPT = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")


def _wide_console():
    """The table needs ~110 columns; a pipe or test runner gets that width, a terminal its own."""
    from rich.console import Console

    c = console()
    return c if c.is_terminal else Console(highlight=False, soft_wrap=False, width=120)


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B"


def model_summary_dict(spec: Any, modules_top: int = 5) -> dict:
    """Every field of a ModelSpec plus the derived sizes, as JSON-ready data (counts in elements)."""
    d = spec.model_dump(mode="json")
    mods = sorted(spec.modules(), key=lambda m: -m.params)
    d["largest_modules"] = [{"name": m.name, "params": m.params} for m in mods[:modules_top]]
    d["num_tensors"] = len(spec.tensors)
    d["tensor_params"] = sum(t.numel for t in spec.tensors if t.tied_to is None)
    d["tied"] = [{"name": t.name, "tied_to": t.tied_to} for t in spec.tensors if t.tied_to]
    if spec.published_params is not None:
        d["matches_published"] = spec.params == spec.published_params
    return d


def list_rows() -> list[dict]:
    """One summary dict per catalog model (name order)."""
    from zeroplan.specs.model import catalog_names, load_model

    rows = []
    for name in catalog_names():
        s = load_model(name)
        rows.append({
            "name": s.name, "hf_repo": s.hf_repo, "model_type": s.model_type, "params": s.params,
            "published_params": s.published_params, "active_params": s.active_params,
            "num_layers": s.num_layers, "hidden_size": s.hidden_size,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "intermediate_size": s.intermediate_size, "vocab_size": s.vocab_size,
            "tie_word_embeddings": s.tie_word_embeddings, "num_experts": s.num_experts,
            "experts_per_token": s.experts_per_token,
            "largest_module_name": s.largest_module_name, "largest_module_params": s.largest_module_params,
        })
    return rows


def register(app: typer.Typer) -> None:
    models_app = typer.Typer(
        help="The bundled model catalog and exact parameter counts of any model spec.",
        no_args_is_help=True,
    )
    app.add_typer(models_app, name="models")

    @models_app.command("list")
    @handle_errors
    def list_cmd(json_out: bool = JSON_OPT) -> None:
        """List the catalog: published config.json files with exact parameter counts."""
        rows = list_rows()
        if json_out:
            print_json({"models": rows})
            return
        from rich import box
        from rich.table import Table

        t = Table(title="zeroplan model catalog (counts are parameters, B = 10^9)", box=box.SIMPLE_HEAD)
        for col, just in (("name", "left"), ("model_type", "left"), ("params", "right"), ("B", "right"),
                          ("layers", "right"), ("hidden", "right"), ("heads/kv", "right"),
                          ("vocab", "right"), ("tied", "center"), ("MoE", "left")):
            t.add_column(col, justify=just, no_wrap=True)
        for r in rows:
            moe = f"{r['num_experts']}x top-{r['experts_per_token']}" if r["num_experts"] else "-"
            t.add_row(r["name"], r["model_type"], f"{r['params']:,}", f"{r['params'] / 1e9:,.2f}",
                      str(r["num_layers"]), f"{r['hidden_size']:,}",
                      f"{r['num_attention_heads']}/{r['num_key_value_heads']}", f"{r['vocab_size']:,}",
                      "yes" if r["tie_word_embeddings"] else "no", moe)
        _wide_console().print(t)

    @models_app.command("show")
    @handle_errors
    def show_cmd(
        model: str = typer.Argument(..., help="Catalog name, path to an HF config.json (or its directory), or a count such as 7B, 70e9, 1.3T."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Show one model: architecture, exact parameter count, largest module, per-layer size, notes."""
        from zeroplan.specs.model import load_model

        spec = load_model(model)
        d = model_summary_dict(spec)
        if json_out:
            print_json(d)
            return
        from rich.table import Table

        from zeroplan.report.render import esc

        t = Table(title=esc(f"{spec.name}  ({spec.source})"), show_header=False)
        t.add_column("field")
        t.add_column("value", overflow="fold")
        if spec.source.startswith("count:"):
            exact = "as stated; the shape below is a default"
        else:
            exact = "approximate" if spec.approximate else "exact"
        t.add_row("model_type", esc(spec.model_type))
        if spec.hf_repo:
            t.add_row("hf_repo", esc(spec.hf_repo))
        t.add_row("params", f"{spec.params:,}  ({_billions(spec.params)}, {exact})")
        if spec.published_params is not None:
            ok = "matches" if spec.params == spec.published_params else "DIFFERS from"
            t.add_row("published", f"{spec.published_params:,} — {ok} the computed count")
        if spec.num_experts:
            t.add_row("active params", f"{spec.active_params:,}  ({_billions(spec.active_params)} per token, "
                                       f"top-{spec.experts_per_token} of {spec.num_experts} experts)")
        t.add_row("largest module", esc(f"{spec.largest_module_name}: {spec.largest_module_params:,}"))
        t.add_row("per layer", f"{spec.per_layer_params:,}  (layer 0)")
        t.add_row("embedding", f"{spec.embedding_params:,}")
        t.add_row("layers", str(spec.num_layers))
        t.add_row("hidden", f"{spec.hidden_size:,}")
        t.add_row("heads / kv heads", f"{spec.num_attention_heads} / {spec.num_key_value_heads} (head_dim {spec.head_dim})")
        t.add_row("intermediate", f"{spec.intermediate_size:,} ({'gated' if spec.gated_mlp else 'plain'} MLP)")
        t.add_row("vocab", f"{spec.vocab_size:,}")
        if spec.max_position_embeddings:
            t.add_row("max positions", f"{spec.max_position_embeddings:,}")
        t.add_row("tied embeddings", "yes" if spec.tie_word_embeddings else "no")
        t.add_row("tensors", f"{len(spec.tensors):,}")
        for n in spec.notes:
            t.add_row("note", esc(n))
        console().print(t)
