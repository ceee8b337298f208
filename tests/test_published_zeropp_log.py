"""ZeRO-3 and ZeRO++ phase by phase against the ZeRO++ tutorial's two training logs.

tests/data/published/zeropp_tutorial_log.csv holds what Megatron-DeepSpeed's timers printed for the
tutorial's 18B GPT on 64 V100 (4 DGX-2 nodes), 512 tokens per GPU: forward, backward (the recomputation
included) and optimizer milliseconds, and the iteration, for ZeRO-3 ("baseline") and ZeRO++ on the same
cluster within the same hour. These are the only published ZeRO-3 figures with the step split by phase
that zeroplan has: they say how much of each phase's communication the runs hid.

The tutorial does not state the network. The ZeRO-3 iteration fixes it: planned with 1 x 100 Gb/s
InfiniBand per node it is 3% short of the logged one, with 2, 4 or 8 NICs 48-81% short. On that
network the logged forward and backward both lie between zeroplan's schedule (the estimate) and the
no-overlap bracket, near the estimate: the runs hid most of the compute behind the gathers (with
nothing hidden the backward would take 7.4 s, not 6.5 s). The ZeRO++ run on the same cluster lies
inside the bracket too, but 16% above the estimate: its backward hid half of what the plan hides.
Megatron's "optimizer" timer (140 ms, 1.4% of the step) is the plan's GPU optimizer step (its HBM passes,
core/optimizer_step.py) plus the step's collectives (the persistent parameters' gathers, the norm): 55 ms.
The logged step is 2.5 times longer, and the plan does not say why (see the test).
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest

from zeroplan.core.plan import evaluate
from zeroplan.core.timing import TimeEstimate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.hardware import load_profile
from zeroplan.specs.model import spec_from_config
from zeroplan.specs.training import TrainingSetup, get_precision

DATA = Path(__file__).parent / "data" / "published"
# docs/_tutorials/zeropp.md's ds_zeropp_config.json (overlap_comm, contiguous_gradients and
# reduce_scatter are DeepSpeed's stage-3 defaults as well). The baseline is that config without the ZeRO++
# switches: its memory report shows 4421.16 MiB allocated between steps, the model states plus one fp16
# bucket of 1e7 elements (tests/test_published_memory.py::test_megatron_memory_reports), not 5e8's
ZEROPP = ZeroConfig(stage=3, reduce_bucket_size=10_000_000, zero_quantized_weights=True,
                    zero_hpz_partition_size=16, zero_quantized_gradients=True)
CONFIGS = {"baseline": ZeroConfig(stage=3, reduce_bucket_size=10_000_000), "zeropp": ZEROPP}


def _rows() -> dict[str, dict[str, str]]:
    lines = [ln for ln in (DATA / "zeropp_tutorial_log.csv").read_text().splitlines() if ln and not ln.startswith("#")]
    return {r["run"]: r for r in csv.DictReader(lines)}


def _plan(r: dict[str, str], nics: int) -> TimeEstimate:
    hw = load_profile(str(DATA / "profiles" / "dgx2-v100-ib4.toml"))
    hw.inter_node.bandwidth_GBps_per_gpu = nics * 100 / 8 / hw.node.gpus_per_node  # n x 100 Gb/s per node
    hw.inter_node.nics_per_node = nics
    # Megatron pads GPT-2's 50,257-token vocabulary to a multiple of 128: 50,304 rows
    spec = spec_from_config({"model_type": "gpt2", "n_embd": int(r["hidden"]), "n_head": int(r["heads"]),
                             "n_layer": int(r["layers"]), "vocab_size": 50304, "n_positions": int(r["seq_len"]),
                             "tie_word_embeddings": True}, "gpt-18b", "zeropp-tutorial")
    tr = TrainingSetup(precision=get_precision("fp16"), micro_batch=int(r["micro_batch"]), seq_len=int(r["seq_len"]),
                       grad_accum=1, checkpointing="full")
    return evaluate(model=spec, training=tr, zero=CONFIGS[r["run"]], n_gpus=int(r["gpus"]), hardware=hw).time


def _phases(t: TimeEstimate) -> dict[str, tuple[float, float]]:
    """(schedule, nothing hidden) seconds of the forward and the backward: the phase's compute plus its
    exposed communication, or plus all of it (the overlap slowdown is left out: it is not split by phase)."""
    c = t.compute
    assert c is not None
    return {"forward": (c.forward_time_s + t.exposed_by_phase_s["forward"], c.forward_time_s + t.time_by_phase_s["forward"]),
            "backward": (c.backward_time_s + t.exposed_by_phase_s["backward"],
                         c.backward_time_s + t.time_by_phase_s["backward"])}


def test_the_logged_zero3_iteration_fixes_the_network():
    r = _rows()["baseline"]
    err = {n: _plan(r, n).step_time_s / (float(r["iteration_ms"]) / 1e3) - 1 for n in (1, 2, 4, 8)}
    for n, e in err.items():
        print(f"{n} x 100 Gb/s per node: planned ZeRO-3 iteration {e:+.1%} against the log")
    assert abs(err[1]) < 0.10
    assert all(e < -0.4 for n, e in err.items() if n > 1)


@pytest.mark.parametrize("run", ["baseline", "zeropp"])
def test_each_phase_lies_between_the_schedule_and_nothing_hidden(run):
    r = _rows()[run]
    t = _plan(r, 1)
    measured = {"forward": float(r["forward_ms"]) / 1e3, "backward": float(r["backward_ms"]) / 1e3}
    for phase, (est, worst) in _phases(t).items():
        m = measured[phase]
        print(f"{run} {phase}: logged {m:.2f} s, schedule {est:.2f} s ({m / est - 1:+.1%}), nothing hidden {worst:.2f} s")
        assert est < m < worst
    iteration = float(r["iteration_ms"]) / 1e3
    print(f"{run} iteration: logged {iteration:.2f} s, planned {t.step_time_s:.2f} s ({t.step_time_s / iteration - 1:+.1%}), "
          f"bracket {t.step_time_best_s:.2f}-{t.step_time_worst_s:.2f} s")
    assert t.step_time_best_s < iteration < t.step_time_worst_s
    if run == "baseline":  # ZeRO-3 as planned: each phase and the iteration within 10%
        assert all(abs(measured[p] / est - 1) < 0.10 for p, (est, _) in _phases(t).items())
        assert abs(t.step_time_s / iteration - 1) < 0.10
    else:  # ZeRO++ hid less in its backward than planned: 16% short (documented, not tuned away)
        assert -0.20 < t.step_time_s / iteration - 1 < -0.10


def test_the_logged_tflops_are_the_plans_hardware_flops():
    """The log's TFLOPs are Megatron's count with the recomputation: the plan's hardware FLOPs per GPU over the
    logged iteration give them back (to 1%: Megatron counts the unpadded 50,257-token vocabulary)."""
    for r in _rows().values():
        t = _plan(r, 1)
        assert t.compute is not None
        tflops = t.compute.hardware_flops / (float(r["iteration_ms"]) / 1e3) / 1e12
        assert abs(tflops / float(r["tflops"]) - 1) < 0.01


def _implied_slowdown() -> tuple[float, float, list[float]]:
    """What the logs say of the overlap slowdown (``node.overlap_slowdown``: compute lost, as a fraction of the
    communication time it hides behind). The two forwards differ only in the gathers' bytes (ZeRO++ gathers
    int8), so their logged difference over the planned one scales the plan's communication to that network
    (k). In a phase whose communication outlasts its compute the schedule hides all the compute, so the phase
    takes k x its communication plus the slowdown times its compute: s = (logged - k x comm) / compute."""
    rows = _rows()
    plans = {run: _plan(r, 1) for run, r in rows.items()}
    logged = {run: {"forward": float(r["forward_ms"]) / 1e3, "backward": float(r["backward_ms"]) / 1e3}
              for run, r in rows.items()}
    k = ((logged["baseline"]["forward"] - logged["zeropp"]["forward"])
         / (plans["baseline"].time_by_phase_s["forward"] - plans["zeropp"].time_by_phase_s["forward"]))
    slowdowns = []
    for run, t in plans.items():
        c = t.compute
        assert c is not None
        for phase, compute_s in (("forward", c.forward_time_s), ("backward", c.backward_time_s)):
            comm_s = k * t.time_by_phase_s[phase]
            if comm_s > compute_s:  # all but ZeRO++'s backward (intra-node gathers, int4 gradients)
                slowdowns.append((logged[run][phase] - comm_s) / compute_s)
    return k, sorted(slowdowns)[len(slowdowns) // 2], slowdowns


def test_the_logs_imply_an_overlap_slowdown_and_what_it_does_to_the_network_ratios():
    """The forwards' difference gives the gathers' time per byte within 2% of the plan (k), and the three phases
    whose communication outlasts their compute (both forwards, ZeRO-3's backward) each lost 0.16-0.29 of the
    compute they hid: up to twice the planner's default (0.15, from A100/H100/MI250 measurements). A profile
    carrying that figure (what ``zeroplan bench overlap`` would write on that cluster) moves the 384-GPU
    figures' ratio pairs (tests/test_published_zeropp.py) from a median difference of 0.113 to 0.104; only
    nothing hidden at all (1.0) reproduces them (0.045). So the 384-GPU runs hid far less than these 64-GPU
    runs of the same software on the same kind of node did, and the slowdown measured here does not explain
    the difference."""
    from test_published_zeropp import _pairs  # the ZeRO++ figures' 10 slow/fast-network pairs

    k, s, each = _implied_slowdown()
    print(f"gathers' time per byte, logged / planned: {k:.3f}; slowdown per phase {[round(x, 3) for x in each]}, median {s:.3f}")
    assert abs(k - 1) < 0.02
    assert len(each) == 3 and all(0.15 < x < 0.31 for x in each)
    median = statistics.median(abs(p - m) for _, p, m in _pairs(s))
    print(f"ZeRO++ figures' ratio pairs with slowdown {s:.3f}: median |difference| {median:.3f}")
    assert 0.1 < median < 0.11


def test_the_logged_optimizer_step_is_longer_than_its_hbm_passes():
    """The plan's optimizer step (HBM passes at 80% of the V100's 900 GB/s over 288M fp16 elements per GPU, 74
    bytes each) and the step's collectives are 40% of Megatron's "optimizer" timer. What the rest is, the log
    does not say. Megatron's timer starts when this rank's own backward has finished (it synchronises the
    device), so it includes the wait at the step's first collective for the slowest of the 64 ranks, and the
    step's host work; the plan counts neither. The DeepSpeed of those logs (0.8.x, March 2023) did not
    synchronise the host per tensor in this step (v0.8.2 stage3.py: one ``.item()`` for the norm, and an
    overflow flag accumulated during the reduction), so that is not it."""
    for run in ("baseline", "zeropp"):
        r = _rows()[run]
        t = _plan(r, 1)
        planned = t.gpu_optimizer_time_s + t.time_by_phase_s["step"]
        logged = float(r["optimizer_ms"]) / 1e3
        print(f"{run}: optimizer logged {logged * 1e3:.1f} ms, planned {planned * 1e3:.1f} ms "
              f"(HBM passes {t.gpu_optimizer_time_s * 1e3:.1f} ms of {t.gpu_optimizer_bytes / 1e9:.2f} GB, "
              f"step collectives {t.time_by_phase_s['step'] * 1e3:.1f} ms)")
        assert t.gpu_optimizer_bytes == 74 * 288_043_968  # fp16 ZeRO-3: overflow 4, norm 18, flatten 4, cast 6,
        # unscale 8, Adam 28, copy back 6
        assert 0.3 * logged < planned < logged
