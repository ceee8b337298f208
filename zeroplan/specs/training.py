"""How the model is trained: precision preset, optimizer, batch shape, checkpointing.

Conventions: bytes per parameter are integers or exact fractions of a byte (8-bit Adam
states are 2 bytes/param); element counts are ints.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroplan._util import InputError

__all__ = [
    "PrecisionPreset",
    "OptimizerPreset",
    "PRECISIONS",
    "OPTIMIZERS",
    "TrainingSetup",
    "get_precision",
    "get_optimizer",
    "OPTIMIZER_IMPLS",
    "GRAD_ACCUM_DTYPES",
    "ACTIVATION_IMPLS",
    "KERNELS",
]

# How the Adam step is executed on the GPU (what it allocates beside the states; core/memory_states.py):
#   fused-adam     DeepSpeed FusedAdam (a DeepSpeed config `optimizer` block on CUDA)
#   torch-foreach  torch.optim.Adam/AdamW with foreach (a client optimizer, or `torch_adam: true`)
#   torch-fused    torch.optim.Adam/AdamW(fused=True)
#   torch-single   torch.optim.Adam/AdamW(foreach=False): one tensor at a time
#   cpu-adam       DeepSpeedCPUAdam (optimizer offload): the step runs on the host
OPTIMIZER_IMPLS = ("fused-adam", "torch-foreach", "torch-fused", "torch-single", "cpu-adam")
# Which code computes the activations (core/activations.py):
#   transformers  the model as transformers implements it (the shipped trace; the default)
#   megatron      Megatron-LM's GPT-2 as DeepSpeedExamples ships it (core/activations_megatron.py)
ACTIVATION_IMPLS = ("transformers", "megatron")
# How the model's element-wise (non-matmul) kernels run (core/elementwise.py): fused kernels (torch.compile,
# Liger, Apex/Transformer Engine norms, Megatron-LM, llm-foundry, torchtitan); transformers' modeling code op
# by op with the module in the training dtype (DeepSpeed's engine, FSDP mixed precision); the same code under
# torch.autocast with fp32 weights (DDP + AMP: the HF Trainer without DeepSpeed or FSDP).
KERNELS = ("fused", "unfused", "unfused-amp")
# data_types.grad_accum_dtype (None = the model dtype, DeepSpeed's default)
GRAD_ACCUM_DTYPES = ("fp32", "bf16", "fp16")


class PrecisionPreset(BaseModel):
    """Bytes per parameter for the model's own copy, its gradients, and the compute dtype."""

    model_config = ConfigDict(defer_build=True, frozen=True)
    name: str
    param_bytes: int  # the working (compute) copy of the weights
    grad_bytes: int  # gradients, same dtype as params under DeepSpeed ZeRO
    master_bytes: int  # fp32 master partition DeepSpeed keeps under ZeRO (also in fp32 training)
    comm_bytes: int  # communication dtype (communication_data_type default = model dtype)
    activation_bytes: int  # activations in the compute dtype
    dtype: str  # torch-style dtype name of params ("float32", "bfloat16", "float16")
    mixed: bool


class OptimizerPreset(BaseModel):
    """Optimizer state bytes per parameter, excluding the fp32 master copy."""

    model_config = ConfigDict(defer_build=True, frozen=True)
    name: str
    state_bytes: float  # Adam: m + v = 8; SGD momentum: 4; SGD: 0; 8-bit Adam: 2
    description: str


PRECISIONS: dict[str, PrecisionPreset] = {
    "fp32": PrecisionPreset(
        name="fp32", param_bytes=4, grad_bytes=4, master_bytes=4, comm_bytes=4,
        activation_bytes=4, dtype="float32", mixed=False,
    ),
    "bf16": PrecisionPreset(
        name="bf16", param_bytes=2, grad_bytes=2, master_bytes=4, comm_bytes=2,
        activation_bytes=2, dtype="bfloat16", mixed=True,
    ),
    "fp16": PrecisionPreset(
        name="fp16", param_bytes=2, grad_bytes=2, master_bytes=4, comm_bytes=2,
        activation_bytes=2, dtype="float16", mixed=True,
    ),
}

OPTIMIZERS: dict[str, OptimizerPreset] = {
    "adamw": OptimizerPreset(name="adamw", state_bytes=8, description="Adam/AdamW: fp32 momentum + variance"),
    "adam": OptimizerPreset(name="adam", state_bytes=8, description="Adam: fp32 momentum + variance"),
    "sgd-momentum": OptimizerPreset(name="sgd-momentum", state_bytes=4, description="SGD with fp32 momentum"),
    "sgd": OptimizerPreset(name="sgd", state_bytes=0, description="plain SGD, no state"),
    "adam8bit": OptimizerPreset(name="adam8bit", state_bytes=2, description="8-bit Adam (bitsandbytes): int8 m + v"),
}


def get_precision(name: str) -> PrecisionPreset:
    key = str(name).lower().replace("bfloat16", "bf16").replace("float16", "fp16").replace("float32", "fp32")
    if key not in PRECISIONS:
        raise InputError(f"--precision {name!r} is unknown; expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[key]


def get_optimizer(name: str) -> OptimizerPreset:
    key = str(name).lower().replace("_", "-")
    aliases = {"sgd-m": "sgd-momentum", "momentum": "sgd-momentum", "adam-8bit": "adam8bit", "adamw8bit": "adam8bit"}
    key = aliases.get(key, key)
    if key not in OPTIMIZERS:
        raise InputError(f"--optimizer {name!r} is unknown; expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[key]


class TrainingSetup(BaseModel):
    """The training-loop shape that memory and time depend on."""

    model_config = ConfigDict(defer_build=True)

    precision: PrecisionPreset = PRECISIONS["fp32"]
    precision_source: str = "default (no DeepSpeed config: fp32)"
    optimizer: OptimizerPreset = OPTIMIZERS["adamw"]
    micro_batch: int = Field(1, ge=1)
    seq_len: int = Field(2048, ge=1)
    grad_accum: int = Field(1, ge=1)
    checkpointing: Literal["none", "selective", "full"] = "none"
    flash_attention: bool = True
    optimizer_impl: Literal["fused-adam", "torch-foreach", "torch-fused", "torch-single", "cpu-adam"] = "fused-adam"
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    activation_impl: Literal["transformers", "megatron"] = "transformers"
    kernels: Literal["fused", "unfused", "unfused-amp"] = "fused"  # KERNELS: element-wise traffic (core/elementwise.py)
    # DeepSpeed's activation_checkpointing.cpu_checkpointing: the layer checkpoints live in host memory
    # (only where the script checkpoints through deepspeed.checkpointing: activation_impl "megatron")
    cpu_checkpointing: bool = False
    partition_activations: bool = False  # activation_checkpointing.partition_activations (copies each argument)

    @property
    def optimizer_bytes_per_param(self) -> float:
        """K in the ZeRO paper: fp32 master + optimizer states (12 for Adam)."""
        return self.precision.master_bytes + self.optimizer.state_bytes

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch * self.seq_len
