"""Model specs: what is trained, with its exact parameter inventory.

A ModelSpec carries the architecture fields (from an HF config.json, the bundled catalog
or a bare count) and the exact parameter inventory: every parameter tensor with the
module that owns it directly, named as in the Hugging Face implementation. Everything
else (params, largest module, per-layer sizes) is derived from that inventory, so counts
are exact to the parameter. All sizes here are ELEMENT counts (parameters), never bytes.

``load_model(ref)`` accepts, decided in this order:

1. an existing path: an HF ``config.json`` or a directory containing one;
2. a catalog name (case-insensitive), e.g. ``llama-2-7b`` — the bundled catalog in
   ``zeroplan/specs/catalog/<name>.json`` ships the published config.json of each model
   and its published parameter count;
3. a count such as ``7B``, ``70e9``, ``1.3T``, ``125M``;
4. otherwise an InputError that suggests close catalog names.

Families parsed exactly (``model_type``): llama, mistral, mixtral, qwen2, gemma, gpt2,
gpt_neox, falcon, phi, phi3. Any other ``model_type`` falls back to a generic llama-like
decoder (``approximate=True``) built from hidden_size / num_hidden_layers /
num_attention_heads / intermediate_size / vocab_size (or n_embd / n_layer / n_head /
n_inner).

MoE experts are named as in the published checkpoints and transformers 4.x
(``model.layers.N.block_sparse_moe.experts.E.w1`` ...), one module per expert
projection. transformers >= 5 fuses each layer's experts into one parameter; the parameter
count is the same, the largest directly-owned module is not (a note on the spec says so).

Count specs (``70B``): ``params`` is the stated count EXACTLY (the planner multiplies it
by bytes per parameter). The spec also carries a default llama-style shape so that
activations, per-layer sizes and the largest module can be estimated: the rule is

- take the row of ``DEFAULT_SHAPES`` (known llama-style shapes, head_dim 128, vocab
  32000, gated SiLU MLP, untied embeddings, no biases) whose own parameter count is
  nearest the stated count on a log scale;
- keep its hidden size, heads and intermediate size, and pick the number of layers
  (>= 1) that brings the shape's count nearest the stated count.

The tensors of that shape do not sum to ``params`` exactly; ``approximate=True`` and the
notes say so and by how much.

Where each part lives (specs/): ``model_spec`` (``ParamTensor``, ``ModelSpec``, ``ROLES``, the
inventory counted into a spec, ``spec_from_config``), ``model_hf_config`` (typed config.json
reads, the local Hugging Face Hub cache), ``model_families`` (one parser per ``model_type``),
``model_scale`` (``ModelSpec.scaled``'s config edit), ``model_count`` (count specs,
``DEFAULT_SHAPES``), ``model_catalog`` (the bundled catalog) and ``model_load``
(``load_model``). This module re-exports their names, public and private, so
``from zeroplan.specs.model import ...`` keeps working.
"""

from __future__ import annotations

from zeroplan._util import InputError, display_path, parse_count, read_text_file, safe_text  # noqa: F401
from zeroplan.specs.model_catalog import (  # noqa: F401
    _CATALOG_DIR,
    _catalog_entry_cached,
    _catalog_files,
    _catalog_spec_cached,
    _fresh,
    _hub_catalog_key,
    _hub_index,
    _unknown,
    catalog_entry,
    catalog_names,
)
from zeroplan.specs.model_count import (  # noqa: F401
    _COUNT_VOCAB,
    DEFAULT_SHAPES,
    _shape_config,
    _shape_params,
    spec_from_count,
)
from zeroplan.specs.model_families import (  # noqa: F401
    _FAMILIES,
    SUPPORTED_MODEL_TYPES,
    _conv1d,
    _falcon,
    _gpt2,
    _gpt_neox,
    _heads,
    _lin,
    _llama_like,
    _norm,
    _phi,
    _T,
)
from zeroplan.specs.model_hf_config import (  # noqa: F401
    _HUB_ID,
    _LAYER_KEYS,
    _MAX_DIM,
    MAX_LAYERS,
    _Cfg,
    _parse_json,
    hf_cache_config,
    hf_hub_cache_dir,
)
from zeroplan.specs.model_load import _load_path, load_model  # noqa: F401
from zeroplan.specs.model_scale import _DEFAULT_SCALE_KEYS, _SCALE_KEYS  # noqa: F401
from zeroplan.specs.model_spec import (  # noqa: F401
    ROLES,
    ModelSpec,
    ModuleParams,
    ParamTensor,
    _build,
    _generic,
    _scale,
    spec_from_config,
)

__all__ = [
    "ParamTensor",
    "ModuleParams",
    "ModelSpec",
    "ROLES",
    "SUPPORTED_MODEL_TYPES",
    "DEFAULT_SHAPES",
    "load_model",
    "spec_from_config",
    "spec_from_count",
    "catalog_names",
    "catalog_entry",
]
