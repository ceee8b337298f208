"""`zeroplan validate`: measure what a GPU node really allocates and set it beside the planner.

Every measurement takes a ``device`` ("cuda" on the node; "cpu" where the figure means the
same thing there, which is how the functions are unit-tested) and returns rows of
``{"check", "figure", "predicted", "measured", "unit", "note"}`` (bytes unless ``unit`` says
otherwise; ``predicted`` None when the planner has no such figure):

- ``measure_context``: CUDA context + library workspace (cuBLAS) = device memory in use
  (``mem_get_info``) that the caching allocator does not account for. CUDA only.
- ``measure_optimizer_temps``: peak bytes one optimizer step allocates beyond its states,
  per element, for torch AdamW foreach / fused and DeepSpeed FusedAdam (CUDA, when DeepSpeed
  and its op build are available); the planner charges 4 B/element (core/memory.py).
- ``measure_optimizer_time``: the same steps timed over 64M fp32 elements, against the HBM passes
  core/optimizer_step.py plans for them at the profile's HBM bandwidth × 0.8.
- ``measure_layer_activations``: bytes autograd saves for one real transformers
  ``LlamaDecoderLayer`` (``torch.autograd.graph.saved_tensors_hooks``, storages counted once,
  parameters excluded) vs ``core.activations.layer_activation_bytes``.
- ``measure_engine_peak``: the bundled engine (DeepSpeed-on-CUDA mimic) for one step on
  this device: allocated and reserved at the peak (reserved only on CUDA).
- ``measure_deepspeed_virtual`` (bench/validate_deepspeed.py): REAL DeepSpeed as rank 0 of a
  virtual ``n``-GPU job on real tensors, at stages 2 and 3: torch's fake process group answers every
  collective, so rank 0 allocates exactly what it would in an ``n``-rank job; compared with the
  planner at ``--gpus n``.
- ``gemm`` (bench/gemm_check.py): one layer's matmuls and the LM head timed at their training
  shapes, TFLOP/s against the compute model's matmul rate on ``--hardware``.
- ``compute`` (bench/compute_check.py): an HBM copy, one layer's attention core and the model's own
  forward + backward (transformers, the validated layers at full width) timed against the compute
  model's element-wise rate, attention time and step time (``kernels="unfused"``).
- ``multi_gpu_checks`` (bench/gpu_multi.py): on one GPU a one-rank NCCL smoke test of the
  collective bench; with >= 2 GPUs, an NCCL collective sweep and α–β fit against the profile,
  and how much of an all-gather hides behind matmuls (``bench/overlap.py``) against the
  planner's slowdown.
- ``pcie`` (bench/pcie_check.py): pinned host <-> GPU copy bandwidth, one GPU alone and all at
  once, against the profile's ``node.pcie_bandwidth_GBps_per_gpu``.
- ``cpu-adam`` (bench/cpu_adam.py ``validation_rows``): DeepSpeedCPUAdam's rate per core with one
  process per GPU stepping at once, against the profile's ``node.cpu_adam_params_per_s_per_core``.

``run_validation`` runs all of them and returns the report that
``zeroplan.bench.validate_report`` writes as JSON and markdown.
"""

from __future__ import annotations

import platform
from typing import Any, Callable

from zeroplan.bench.gpu_multi import multi_gpu_checks
from zeroplan.bench.validate_deepspeed import deepspeed_stages, measure_deepspeed_virtual
from zeroplan.bench.validate_rows import op_build_failure, row
from zeroplan.bench.validate_rows import skip_row as _skip

__all__ = ["row", "measure_context", "measure_optimizer_temps", "measure_optimizer_time", "measure_layer_activations",
           "measure_engine_peak", "measure_deepspeed_virtual", "multi_gpu_checks", "run_validation",
           "OPTIMIZER_IMPLS", "CHECKS"]

OPTIMIZER_IMPLS = ("foreach", "fused", "fused_adam")
# every check run_validation knows, in the order it runs them (`zeroplan validate --checks`). The two
# that fork ranks come first: a child forked after its parent initialised CUDA cannot use CUDA ("Cannot
# re-initialize CUDA in forked subprocess", seen on an H200 when they ran last), and every other check
# initialises it in this process.
CHECKS = ("multi-gpu", "cpu-adam", "context", "optimizer", "activations", "gemm", "compute", "engine", "deepspeed",
          "pcie")


# ---------------------------------------------------------------------- context
def measure_context(device: str, *, cuda: Any = None) -> list[dict[str, Any]]:
    """Device memory in use outside the caching allocator: CUDA context, then + cuBLAS workspace."""
    if device != "cuda":
        return [_skip("context", "CUDA context memory exists on CUDA devices only")]
    import torch

    cuda = cuda if cuda is not None else torch.cuda
    dev = cuda.current_device()
    cuda.init()
    free, total = cuda.mem_get_info(dev)
    ctx = int(total - free - cuda.memory_reserved(dev))
    a = torch.ones(256, 256, device="cuda")
    held = cuda.memory_allocated(dev)
    (a @ a).sum().item()  # first GEMM: cuBLAS handle and workspace
    cuda.synchronize(dev)
    free2, _ = cuda.mem_get_info(dev)
    with_ws = int(total - free2 - cuda.memory_reserved(dev))
    after_fp32 = cuda.memory_allocated(dev) - held
    b = a.to(torch.bfloat16)
    bias = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    held = cuda.memory_allocated(dev)
    torch.nn.functional.linear(b, b, bias).sum().item()  # bf16 with a bias: the cuBLASLt path
    cuda.synchronize(dev)
    after_lt = cuda.memory_allocated(dev) - held
    del a, b, bias
    # torch allocates cuBLAS/cuBLASLt workspaces through the caching allocator (CublasHandlePool.cpp
    # getNewWorkspace), so they count in memory_allocated, not in the context outside it
    return [row("context", "CUDA context (used - reserved, before any kernel)", None, ctx),
            row("context", "context + cuBLAS workspace after the first GEMM", None, with_ws),
            row("context", "allocated by the first fp32 GEMM and kept (cuBLAS workspace in the allocator)", None,
                int(after_fp32)),
            row("context", "allocated by the first bf16 linear with bias and kept (cuBLASLt workspace)", None,
                int(after_lt)),
            row("context", "device total memory", None, int(total))]


# ---------------------------------------------------------------------- optimizer
def _make_optimizer(impl: str, params: list, torch: Any) -> Any:
    if impl == "foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True, fused=False)
    if impl == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    from deepspeed.ops.adam import FusedAdam  # CUDA: JIT-builds the multi_tensor_adam op

    return FusedAdam(params, lr=1e-3, adam_w_mode=True)


class _NotOnThisDevice(Exception):
    pass


def _optimizer_for(impl: str, device: str, numel: int, torch: Any) -> Any:
    """AdamW of ``impl`` over one fp32 tensor of ``numel`` elements with its gradient set."""
    if impl == "fused_adam" and device != "cuda":
        raise _NotOnThisDevice("DeepSpeed FusedAdam is a CUDA kernel")
    p = torch.nn.Parameter(torch.zeros(numel, device=device))
    p.grad = torch.full_like(p, 1e-3)
    return _make_optimizer(impl, [p], torch)


def _unavailable(exc: Exception) -> str:
    return str(exc) if isinstance(exc, _NotOnThisDevice) else op_build_failure(exc)


def measure_optimizer_temps(device: str, numel: int = 1 << 22,
                            impls: tuple[str, ...] = OPTIMIZER_IMPLS,
                            predicted_per_element: float | None = 4.0) -> list[dict[str, Any]]:
    """Peak bytes beyond the states during one AdamW step over an fp32 tensor of ``numel``."""
    import torch

    from zeroplan.runtime.memory import StorageTracker

    out = []
    for impl in impls:
        try:
            opt = _optimizer_for(impl, device, numel, torch)
            opt.step()  # creates the states (exp_avg, exp_avg_sq, step)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                opt.step()
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated() - base
            else:
                tracker = StorageTracker()
                with tracker:
                    opt.step()
                extra = tracker.phase_peaks().get("forward", {}).get("peak", 0)
        except Exception as exc:  # noqa: BLE001 - an unavailable implementation is a skipped row
            out.append(_skip(f"optimizer {impl}", _unavailable(exc)))
            continue
        pred = predicted_per_element if impl == "foreach" else (0.0 if predicted_per_element is not None else None)
        out.append(row(f"optimizer {impl}", "step temporaries per element", pred, extra / numel,
                       unit="bytes/element",
                       note=f"peak beyond states over {numel:,} fp32 elements; planner: 4 B/element for foreach"))
        del opt
    return out


_IMPL_OF = {"foreach": "torch-foreach", "fused": "torch-fused", "fused_adam": "fused-adam"}


def measure_optimizer_time(device: str, hardware: Any = None, numel: int | None = None, iters: int = 5,
                           impls: tuple[str, ...] = OPTIMIZER_IMPLS) -> list[dict[str, Any]]:
    """One AdamW step over an fp32 tensor of ``numel``, timed, beside the plan's HBM passes for it
    (core/optimizer_step.py ``inner_step_passes`` at ``hbm_bandwidth_GBps × HBM_EFFICIENCY``; predicted
    only with ``hardware``). On CPU the rows exist so the code path is tested."""
    import torch

    from zeroplan.bench.gemm_check import timer
    from zeroplan.core.compute import HBM_EFFICIENCY, hbm_stream_time_s
    from zeroplan.core.optimizer_step import inner_step_passes
    from zeroplan.specs.training import TrainingSetup

    numel = numel or (1 << 26 if device == "cuda" else 1 << 20)  # 64M: 1 GiB of states, far beyond any L2
    timed = timer(device, torch)
    out = []
    for impl in impls:
        try:
            opt = _optimizer_for(impl, device, numel, torch)
            t = timed(opt.step, iters)
        except Exception as exc:  # noqa: BLE001 - an unavailable implementation is a skipped row
            out.append(_skip(f"optimizer {impl} time", _unavailable(exc)))
            continue
        per_el = sum(b for _, b in inner_step_passes(TrainingSetup(optimizer_impl=_IMPL_OF[impl])))
        pred = None if hardware is None else hbm_stream_time_s(per_el * numel, hardware)
        out.append(row(f"optimizer {impl} time", f"AdamW step over {numel:,} fp32 elements",
                       None if pred is None else pred * 1e3, t * 1e3, unit="ms",
                       note=f"{per_el} B/element planned: {per_el * numel / t / 1e9:,.0f} GB/s achieved; planner: HBM "
                            f"bandwidth × {HBM_EFFICIENCY} (core/optimizer_step.py)"))
        del opt
    return out


# ---------------------------------------------------------------------- activations
def measure_layer_activations(device: str, spec: Any, *, seq_len: int, micro_batch: int,
                              precision: str = "bf16") -> list[dict[str, Any]]:
    """Saved-for-backward bytes of one transformers LlamaDecoderLayer at ``spec``'s width."""
    try:
        import transformers  # noqa: F401
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    except Exception as exc:  # noqa: BLE001
        return [_skip("activations", f"transformers is not importable: {exc}"[:300])]
    import torch

    from zeroplan.core.activations import layer_activation_bytes
    from zeroplan.runtime.model import resolve_dtype

    dtype = resolve_dtype(torch, precision)
    cfg = LlamaConfig(hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                      num_key_value_heads=spec.num_key_value_heads or spec.num_attention_heads,
                      intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size, num_hidden_layers=1,
                      head_dim=spec.head_dim)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).to(device=device, dtype=dtype)
    rope = LlamaRotaryEmbedding(cfg).to(device)
    params = {id(p.untyped_storage()) for p in layer.parameters()}
    x = torch.randn(micro_batch, seq_len, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)
    pos_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch, -1)
    cos_sin = rope(x, pos_ids)
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if id(st) not in params:
            saved[id(st)] = int(st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, position_embeddings=cos_sin, position_ids=pos_ids)
    out = out[0] if isinstance(out, tuple) else out
    measured = sum(saved.values())
    out.float().sum().backward()
    act_bytes = 4 if precision == "fp32" else 2
    pred = layer_activation_bytes(spec, seq_len, micro_batch, act_bytes, flash_attention=True)
    return [row("activations", f"one LlamaDecoderLayer, saved for backward (transformers "
                f"{transformers.__version__}, sdpa, {precision}, b={micro_batch}, s={seq_len}, h={spec.hidden_size})",
                pred, measured, note="planner: core.activations.layer_activation_bytes (flash attention)")]


# ---------------------------------------------------------------------- engine peak
def measure_engine_peak(device: str, spec: Any, zero: Any, *, precision: str, micro_batch: int,
                        seq_len: int, n: int = 1, plan: Any = None) -> list[dict[str, Any]]:
    """The bundled engine on this device for 2 steps (rank 0 of ``n`` via LocalComm copies):
    allocated and, on CUDA, reserved at the highest phase peak of the second step."""
    import torch

    from zeroplan.runtime.comm import LocalComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.memory import make_meter
    from zeroplan.runtime.model import build_model

    dev = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    meter = make_meter(dev)
    with meter:
        model = build_model(spec, precision, dev, seed=0)
        eng = ZeroEngine(model, zero, precision=precision, comm=LocalComm(n), meter=meter)
        gen = torch.Generator().manual_seed(0)
        for s in range(2):
            if s == 1:
                meter.reset_peaks()
            eng.train_step([torch.randint(0, spec.vocab_size, (micro_batch, seq_len), generator=gen).to(dev)])
        eng.close()
    peaks = meter.phase_peaks()
    phase, top = max(peaks.items(), key=lambda kv: kv[1]["peak"])
    mem = getattr(plan, "memory", None)
    rows = [row("engine", f"peak allocated ({phase}), stage {zero.stage}, N={n}", getattr(mem, "allocated", None),
                top["peak"], note=f"bundled engine, mimic {eng.mimic}")]
    if "reserved_peak" in top:
        rows.append(row("engine", f"peak reserved ({phase}), stage {zero.stage}, N={n}", getattr(mem, "reserved", None),
                        top["reserved_peak"], note="max_memory_reserved in the peak phase"))
    return rows


def environment(device: str) -> dict[str, Any]:
    """Versions and the device, for the report."""
    import torch

    env: dict[str, Any] = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                           "host": platform.node()}
    for mod in ("deepspeed", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, gpu_count=torch.cuda.device_count(), cuda=torch.version.cuda,
                   gpu_total_bytes=int(props.total_memory))
    return env


def run_validation(device: str, *, model: str = "llama-2-7b", gpus: int = 8, precision: str = "bf16",
                   micro_batch: int = 1, seq_len: int = 512, layers: int = 2, hidden: int | None = None,
                   hardware: Any = None, checks: tuple[str, ...] | None = None,
                   progress: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every check on ``device``; returns {"environment", "inputs", "rows"}. ``progress(check, report)``
    is called before each check with the report so far (the command prints it and writes it, so a run
    stopped part-way keeps what it measured)."""
    from zeroplan.bench.cpu_adam import validation_rows as cpu_adam_rows
    from zeroplan.bench.compute_check import measure_compute
    from zeroplan.bench.gemm_check import measure_layer_gemms
    from zeroplan.bench.pcie_check import measure_pcie
    from zeroplan.bench.validate import _zero_config, predict, scaled_spec
    from zeroplan.specs.model import load_model

    full = load_model(model)
    spec = scaled_spec(full, layers=layers, hidden=hidden, vocab=None, experts=None)
    want = set(checks or CHECKS)
    rows: list[dict[str, Any]] = []
    # on CUDA the plan counts what the GPU adds (cuBLAS workspaces, allocator slack) from the profile; a
    # CPU run's tensors are set beside the plan without them
    mem_hw = hardware if device == "cuda" else None
    plan1 = predict(spec, _zero_config(2, None), precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                    grad_accum=1, n=1, hardware=mem_hw)
    # the planner's foreach AdamW temporaries per element (core/memory_states.optimizer_temp_bytes)
    from zeroplan.core.memory_states import optimizer_temp_bytes
    from zeroplan.specs.training import TrainingSetup

    group = 1 << 22
    per_el = optimizer_temp_bytes(TrainingSetup(optimizer_impl="torch-foreach"), group, group) / group

    def gpu_count() -> int:  # through NVML: torch.cuda would initialise CUDA before the ranks fork
        from zeroplan.runtime.gpus import visible_gpu_count

        return visible_gpu_count() if device == "cuda" else 0

    steps: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "context": lambda: measure_context(device),
        "optimizer": lambda: (measure_optimizer_temps(device, predicted_per_element=per_el)
                              + measure_optimizer_time(device, hardware)),
        "activations": lambda: measure_layer_activations(device, spec, seq_len=seq_len, micro_batch=micro_batch,
                                                         precision=precision),
        "gemm": lambda: measure_layer_gemms(device, spec, seq_len=seq_len, micro_batch=micro_batch,
                                            precision=precision, hardware=hardware),
        "compute": lambda: measure_compute(device, spec, seq_len=seq_len, micro_batch=micro_batch,
                                           precision=precision, hardware=hardware),
        "engine": lambda: measure_engine_peak(device, spec, _zero_config(2, None), precision=precision,
                                              micro_batch=micro_batch, seq_len=seq_len, n=1, plan=plan1),
        "deepspeed": lambda: deepspeed_stages(device, spec, n=gpus, precision=precision, micro_batch=micro_batch,
                                              seq_len=seq_len, hardware=mem_hw),
        "multi-gpu": lambda: multi_gpu_checks(gpu_count(), hardware),
        "pcie": lambda: measure_pcie(device, hardware),
        "cpu-adam": lambda: cpu_adam_rows(max(1, gpu_count()), hardware),
    }
    report: dict[str, Any] = {
        "environment": {"device": device},  # the rest at the end: reading the GPU's properties initialises CUDA
        "inputs": {"model": model, "scaled": {"name": spec.name, "params": spec.params, "layers": spec.num_layers,
                                              "hidden": spec.hidden_size},
                   "gpus": gpus, "precision": precision, "micro_batch": micro_batch, "seq_len": seq_len},
        "rows": rows}
    for name in (c for c in CHECKS if c in want):  # CHECKS' order: the checks that fork ranks before CUDA starts here
        fn = steps[name]
        if progress is not None:
            progress(name, report)
        try:
            rows += fn()
        except Exception as exc:  # noqa: BLE001 - one failing check (an OOM, a failed op build) keeps the rest
            rows.append(row(name, "failed", None, None, unit="", note=op_build_failure(exc)))
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    report["environment"] = environment(device)
    return report
