"""The runtime's CUDA paths without a GPU (issue 12 §4): the CUDA meter against a stand-in
``torch.cuda``, collectives timed with (stand-in) CUDA events, a real ``torch.OutOfMemoryError``
as a result, the DeepSpeed-on-CUDA engine mimic, and DeepSpeed's device selection."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zeroplan._util import InputError  # noqa: E402


class FakeCuda:
    """The slice of ``torch.cuda`` the meter uses; the test moves the counters by hand."""

    def __init__(self, total: int = 80 * 2**30) -> None:
        self.total = total
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self.reserved_peak = 0
        self.fraction = None
        self.resets = 0

    def alloc(self, n: int, reserve: int | None = None) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, reserve if reserve is not None else self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def get_device_properties(self, _dev):
        return type("P", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, f, _dev=None):
        self.fraction = f

    def synchronize(self, _dev=None):
        pass

    def reset_peak_memory_stats(self, _dev=None):
        self.resets += 1
        self.peak = self.allocated
        self.reserved_peak = self.reserved

    def memory_allocated(self, _dev=None):
        return self.allocated

    def max_memory_allocated(self, _dev=None):
        return self.peak

    def memory_reserved(self, _dev=None):
        return self.reserved

    def max_memory_reserved(self, _dev=None):
        return self.reserved_peak


def _meta(n_bytes: int):
    return torch.empty(n_bytes, dtype=torch.uint8, device="meta")


def test_cuda_meter_records_allocated_and_reserved_per_phase_with_the_limit():
    from zeroplan.runtime.memory import CudaMemoryMeter

    fc = FakeCuda(total=1000)
    m = CudaMemoryMeter("cuda:0", memory_limit_bytes=600, cuda=fc)
    assert (m.device_total_bytes, m.limit_bytes) == (1000, 600)
    with m:
        assert fc.fraction == pytest.approx(0.6)  # the allocator enforces the limit
        params = _meta(100)
        fc.alloc(100)
        m.tag(params, "params")
        fc.alloc(250, reserve=400)  # activations, untagged
        fc.free(250)  # (freed before backward starts, to isolate what backward allocates)
        m.phase = "backward"  # forward closes: peak 350, reserved 400
        bucket = _meta(50)
        fc.alloc(50)
        m.tag(bucket, "buffers")  # sampled here: params 100 + buffers 50 at allocated 150
        del bucket
        fc.free(50)
        fc.alloc(30)  # something untagged after the bucket died
        m.phase = "step"
    assert fc.fraction == 1.0  # limit lifted on exit
    pk = m.phase_peaks()
    assert pk["forward"]["peak"] == 350 and pk["forward"]["reserved_peak"] == 400
    assert pk["forward"]["by_category"]["params"] == 100 and pk["forward"]["by_category"]["activations"] == 250
    # backward's highest sample was with the bucket alive: the breakdown keeps it even though
    # the bucket was gone when the phase closed
    b = pk["backward"]
    assert b["peak"] == 150 and b["by_category"]["buffers"] == 50 and b["by_category"]["params"] == 100
    assert m.memory_info()["limit_bytes"] == 600
    assert fc.resets >= 3  # one per phase start


def test_cuda_meter_counts_cpu_tensors_as_host():
    from zeroplan.runtime.memory import CudaMemoryMeter

    fc = FakeCuda()
    m = CudaMemoryMeter("cuda:0", cuda=fc)
    t = torch.zeros(8)  # host (an offloaded state)
    m.tag(t, "optimizer_states")
    assert m.host_bytes == 32 and m.current_by_category()["optimizer_states"] == 0


# ------------------------------------------------------------------ collectives timed with events
class FakeEvent:
    """``torch.cuda.Event`` stand-in: each recorded event gets the next tick (ms) of a clock."""

    clock = [0.0]
    synced = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        FakeEvent.clock[0] += 2.5
        self.t = FakeEvent.clock[0]

    def synchronize(self):
        FakeEvent.synced += 1

    def elapsed_time(self, end):
        return end.t - self.t


@pytest.fixture()
def world1():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_nccl_style_timing_uses_cuda_events_not_host_time(world1):
    from zeroplan.runtime.comm import InstrumentedComm

    comm = InstrumentedComm()
    comm.use_cuda_events(FakeEvent)
    FakeEvent.synced = 0
    comm.all_reduce(torch.ones(4))
    h = comm.all_gather(torch.empty(4), torch.ones(4), async_op=True)
    assert FakeEvent.synced == 0  # nothing waits while the engine runs
    h.wait()
    recs = comm.records
    assert [r.duration_s for r in recs] == [0.0025, 0.0025]  # end - start ticks, ms -> s
    assert FakeEvent.synced == 2


def test_real_cuda_oom_is_a_result_and_the_matrix_goes_on(world1, monkeypatch):
    from zeroplan.bench import validate as v
    from zeroplan.bench.cuda_oom import requested_bytes_from_message
    from zeroplan.runtime import engine as eng
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.model import load_model

    spec = v.scaled_spec(load_model("gpt2"))
    real = eng.ZeroEngine.train_step
    calls = {"n": 0}

    def flaky(self, batches):
        calls["n"] += 1
        if self.stage == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")
        return real(self, batches)

    monkeypatch.setattr(eng.ZeroEngine, "train_step", flaky)
    base = {"precision": "fp32", "micro_batch": 1, "seq_len": 8, "grad_accum": 1, "warmup": 0, "steps": 1,
            "comm_model": "deepspeed"}
    runs = [dict(base, zero=ZeroConfig(stage=1)), dict(base, zero=ZeroConfig(stage=2))]
    out = v.measure_rank(0, 1, spec, runs)
    assert out[0]["oom"]["source"] == "torch.OutOfMemoryError"
    assert out[0]["oom"]["requested_bytes"] == 2 * 2**30 and out[0]["oom"]["phase"] == "forward"
    assert "oom" not in out[1] and out[1]["model_states"]["params"] > 0
    assert requested_bytes_from_message("no size here") is None


def test_other_errors_are_not_swallowed_as_oom(world1, monkeypatch):
    from zeroplan.bench import validate as v
    from zeroplan.runtime import engine as eng
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.model import load_model

    def boom(self, batches):
        raise RuntimeError("not memory")

    monkeypatch.setattr(eng.ZeroEngine, "train_step", boom)
    run = {"precision": "fp32", "micro_batch": 1, "seq_len": 8, "grad_accum": 1, "warmup": 0, "steps": 1,
           "comm_model": "deepspeed", "zero": ZeroConfig(stage=0)}
    with pytest.raises(RuntimeError, match="not memory"):
        v.measure_rank(0, 1, v.scaled_spec(load_model("gpt2")), [run])


# ------------------------------------------------------------------ the engine as DeepSpeed runs on CUDA
def _train(mimic: str, stage: int, n: int = 4, precision: str = "bf16"):
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.runtime.comm import LocalComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.memory import StorageTracker
    from zeroplan.runtime.model import build_model
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"))
    meter = StorageTracker()
    with meter:
        model = build_model(spec, precision, "cpu", seed=0)
        e = ZeroEngine(model, ZeroConfig(stage=stage, reduce_bucket_size=20000), precision=precision,
                       comm=LocalComm(n), meter=meter, mimic=mimic)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for s in range(2):
            if s == 1:
                meter.reset_peaks()
            r = e.train_step([torch.randint(0, spec.vocab_size, (2, 16), generator=gen)])
            losses.append(r["loss"])
        params = [p.detach().clone() for p in e.params]
        e.close()
    return e, losses, r["model_states"], meter.phase_peaks(), params


def test_mimic_defaults_by_device():
    from zeroplan.runtime.engine import resolve_mimic

    assert resolve_mimic("auto", "cuda") == "deepspeed-cuda" and resolve_mimic("auto", "cpu") == "planner"
    with pytest.raises(ValueError):
        resolve_mimic("deepspeed-tpu", "cpu")


def test_stage1_is_deepspeeds_with_either_mimic():
    """Stage 1's per-parameter gradients and DeepSpeed's step (the fp64 norm pieces, the flatten and its fp32
    cast with the flat copy deleted, the gradient partition freed before the optimizer) are DeepSpeed's on
    CPU and CUDA alike (tests/test_stage1_hooks.py and tests/test_step_norm.py measure them against
    DeepSpeed on CPU): both mimics hold the same gradients and peak alike in the step here, where the
    optimizer's temporary is under the cast moment."""
    _, loss_p, states_p, peaks_p, params_p = _train("planner", 1)
    e_d, loss_d, states_d, peaks_d, params_d = _train("deepspeed-cuda", 1)
    assert loss_p == loss_d and all(torch.equal(a, b) for a, b in zip(params_p, params_d))
    assert states_d["gradients"] == states_p["gradients"] == 2 * sum(e_d.numels)
    assert peaks_p["step"]["peak"] == peaks_d["step"]["peak"]


@pytest.mark.parametrize("mimic,impl", [("deepspeed-cuda", "fused-adam"), ("planner", "torch-foreach")])
def test_stage0_step_is_the_wrapper_deepspeed_builds(mimic, impl):
    """Stage 0 in bf16: with DeepSpeed's FusedAdam (the CUDA mimic) FP16_Optimizer flattens the fp32 casts of every
    gradient (casts and flat copy live together, then the 16-bit gradients go); with a client torch AdamW (the
    CPU mimic, torch's foreach rule) FP16_UnfusedOptimizer casts each beside its 16-bit gradient and the optimizer
    adds one fp32 temporary of the group (tests/test_stage0_deepspeed.py measures the latter on real DeepSpeed).
    Both step peaks are the plan's for that optimizer, but for tensors under a page; the updates are the same."""
    from zeroplan.bench.validate import predict, scaled_spec
    from zeroplan.specs.deepspeed_config import ZeroConfig
    from zeroplan.specs.model import load_model

    _, losses, _, peaks, params = _train(mimic, 0)
    _, losses_p, _, _, params_p = _train("planner", 0)
    assert losses == losses_p and all(torch.equal(a, b) for a, b in zip(params, params_p))
    plan = predict(scaled_spec(load_model("llama-2-7b")), ZeroConfig(stage=0, reduce_bucket_size=20000),
                   precision="bf16", micro_batch=2, seq_len=16, n=4, grad_accum=1, optimizer_impl=impl)
    assert 0 <= peaks["step"]["peak"] - plan.memory.phases["step"].peak < 4096


def test_fused_adam_chunks_match_the_unchunked_update_bit_for_bit(monkeypatch):
    from zeroplan.runtime import engine_base

    # force several chunks on the small model; engine_base is the module whose AdamW reads the constant
    monkeypatch.setattr(engine_base, "FUSED_ADAM_CHUNK", 1000)
    # stage 3: its step is the optimizer's per sub-group, where the unchunked update's group-sized temporary
    # sets the peak (stages 1-2 take DeepSpeed's step with either mimic: its norm and cast moments are larger)
    _, loss_d, _, peaks_d, params_d = _train("deepspeed-cuda", 3, n=1, precision="fp32")
    monkeypatch.undo()
    _, loss_p, _, peaks_p, params_p = _train("planner", 3, n=1, precision="fp32")
    assert loss_p == loss_d and all(torch.equal(a, b) for a, b in zip(params_p, params_d))
    assert peaks_d["step"]["peak"] < peaks_p["step"]["peak"]


# ------------------------------------------------------------------ DeepSpeed's device
class FakeCudaCount:
    def __init__(self, n: int) -> None:
        self.n = n

    def is_available(self) -> bool:
        return self.n > 0

    def device_count(self) -> int:
        return self.n


def test_deepspeed_device_selection():
    from zeroplan.bench.deepspeed_engine import select_device

    assert select_device(2, cuda=FakeCudaCount(0)) == ("cpu", "gloo")
    assert select_device(2, cuda=FakeCudaCount(8)) == ("cuda", "nccl")
    assert select_device(2, "cpu", cuda=FakeCudaCount(8)) == ("cpu", "gloo")
    with pytest.raises(InputError, match="one GPU per rank"):
        select_device(4, cuda=FakeCudaCount(2))  # never two ranks on one GPU
    with pytest.raises(InputError):
        select_device(1, "cuda", cuda=FakeCudaCount(0))


def test_deepspeed_config_keeps_the_optimizer_block_on_cuda(tmp_path):
    import json

    from zeroplan.bench.deepspeed_engine import prepare_ds_config

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                             "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}))
    cpu, _, _ = prepare_ds_config(str(p), nproc=2, micro_batch=1, grad_accum=1, precision=None)
    gpu, _, _ = prepare_ds_config(str(p), nproc=2, micro_batch=1, grad_accum=1, precision=None, device="cuda")
    assert "optimizer" not in cpu and cpu["zero_force_ds_cpu_optimizer"] is False
    assert gpu["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4}}
    assert "zero_force_ds_cpu_optimizer" not in gpu


def test_bench_zero_refuses_more_nccl_ranks_than_gpus(monkeypatch):
    from zeroplan.bench import validate as v
    from zeroplan.specs.model import load_model

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(InputError, match="one GPU per rank, this machine has 2"):
        v.run_bench_zero(v.scaled_spec(load_model("gpt2")), [0], nproc=4, precision="fp32", backend="nccl")
