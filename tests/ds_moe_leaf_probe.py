"""Run by tests/test_moe_leaf.py in a fresh process: transformers' tiny Mixtral under DeepSpeed ZeRO-3
(world size 1, CPU/gloo), and the modules DeepSpeed fetches in one forward and backward, printed as lines
"FETCH [configuration index, module name, elements it fetches, forward]": its own parameters, or all of them
(children included) for a leaf module (``parameter_offload.py`` ``iter_params(recurse=z3_leaf_module)``),
modules without parameters left out; "REDUCE [configuration index, elements]" per gradient in the order
the backward hands it to DeepSpeed's reduction (``reduce_ready_partitions_and_remove_grads``); then
"ESTIMATOR [total, largest_layer_params]" as DeepSpeed's estimators count the model (``stage3.py``
``model_to_params``) and "PARAMS [[name, elements], ...]" in the model's order. Each argument is a configuration, run one after the other in this process (one DeepSpeed start-up for all): a JSON
``zero_optimization.leaf_module`` block, or "default"."""

from __future__ import annotations

import json
import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator  # noqa: E402
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, model_to_params  # noqa: E402
from deepspeed.utils import z3_leaf_module  # noqa: E402

FETCHED: list[tuple[int, str, int, bool]] = []
REDUCED: list[tuple[int, int]] = []  # (configuration, elements) per gradient handed to DeepSpeed's reduction
RECORD: list[int | None] = [None]  # the configuration being recorded
NAMES: dict[int, str] = {}
_inner = PartitionedParameterCoordinator.fetch_sub_module


def _fetch(self, module, forward, *args, **kwargs):
    numel = sum(p.ds_numel for p in module.parameters(recurse=z3_leaf_module(module)))
    if RECORD[0] is not None and numel:
        FETCHED.append((RECORD[0], NAMES.get(id(module), "?"), numel, bool(forward)))
    return _inner(self, module, forward, *args, **kwargs)


PartitionedParameterCoordinator.fetch_sub_module = _fetch
_reduce = DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads


def _reduced(self, param):
    if RECORD[0] is not None:
        REDUCED.append((RECORD[0], int(param.ds_numel)))
    return _reduce(self, param)


DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads = _reduced
cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=64, max_position_embeddings=64,
                                 num_local_experts=4, num_experts_per_tok=2)
deepspeed.init_distributed(dist_backend="gloo")
ids = torch.randint(0, 64, (1, 8))
for index, leaf in enumerate(sys.argv[1:]):
    zero: dict = {"stage": 3}
    if leaf != "default":
        zero["leaf_module"] = json.loads(leaf)
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # zero.Init fails on transformers 5 (Tensor.__new__)
    model.train()
    NAMES.update({id(m): n for n, m in model.named_modules()})
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    for i in range(2):
        RECORD[0] = index if i == 1 else None
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        RECORD[0] = None
        engine.step()
model = transformers.AutoModelForCausalLM.from_config(cfg)
# what DeepSpeed's estimators read of this model: (total parameters, largest_layer_params)
print("ESTIMATOR", json.dumps(model_to_params(model)))
print("PARAMS", json.dumps([[n, p.numel()] for n, p in model.named_parameters()]))
for row in FETCHED:
    print("FETCH", json.dumps(list(row)))
for row in REDUCED:
    print("REDUCE", json.dumps(list(row)))
