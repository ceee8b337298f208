"""The bundled ZeRO engine on gloo/CPU: the schedule it issues, the bytes it keeps, the numbers it trains.

Expected values come from (a) closed forms of the ledger and of the per-rank model states
written out here, independently of zeroplan's code, (b) ``zeroplan.core.plan.evaluate`` (the
planner, a separate implementation), and (c) a plain single-process torch AdamW reference.
Ranks are forked (``launch.spawn``) and each launch runs many configurations.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from zeroplan.specs.deepspeed_config import ZeroConfig  # noqa: E402
from zeroplan.specs.model import load_model  # noqa: E402

RBS = 3000  # small gradient buckets: many calls, buckets split across tensors
THR = 64  # stage-3 persistence threshold: the norms (64 elements) stay whole


def _spec(name: str = "llama-2-7b"):
    from zeroplan.bench.validate import scaled_spec

    return scaled_spec(load_model(name), layers=2, hidden=64, vocab=128)


def _tensors(spec):
    return [t.numel for t in spec.tensors if t.tied_to is None]


def _owned(spec):
    out: dict[str, list[int]] = {}
    for t in spec.tensors:
        if t.tied_to is None:
            out.setdefault(t.module, []).append(t.numel)
    return list(out.values())


def _reads(spec):
    """Per module in call order, the numels its forward reads (a tied head reads the embedding)."""
    numel = {t.name: t.numel for t in spec.tensors if t.tied_to is None}
    out: dict[str, list[int]] = {}
    for t in spec.tensors:
        out.setdefault(t.module, []).append(numel[t.tied_to or t.name])
    return list(out.values())


def _buckets(sizes, cap):
    """Greedy, flush BEFORE adding an overflowing size: the number of buckets."""
    count, cur = 0, 0
    for s in sizes:
        if cur and cur + s > cap:
            count, cur = count + 1, 0
        cur += s
    return count + (1 if cur else 0)


def _bucket_lists(sizes, cap):
    """Greedy, flush BEFORE adding an overflowing size: each bucket's sizes."""
    out, cur = [], []
    for s in sizes:
        if cur and sum(cur) + s > cap:
            out.append(cur)
            cur = []
        cur.append(s)
    return out + ([cur] if cur else [])


def _pack_after(sizes, cap):
    """Greedy, add then flush once the running size exceeds ``cap``: the number of calls."""
    count, cur = 0, 0
    for s in sizes:
        cur += s
        if cur > cap:
            count, cur = count + 1, 0
    return count + (1 if cur else 0)


def _ranges(numels, cap, order):
    offs, pos = [], 0
    for k in numels:
        offs.append((pos, pos + k))
        pos += k
    seq = offs if order == "forward" else offs[::-1]
    out, cur = [], []
    for lo, hi in seq:
        if cur and sum(h - l for l, h in cur) + (hi - lo) > cap:
            out.append((min(l for l, _ in cur), max(h for _, h in cur)))
            cur = []
        cur.append((lo, hi))
    if cur:
        out.append((min(l for l, _ in cur), max(h for _, h in cur)))
    return out


def _owner_slices(lo, hi, part):
    out, a = [], lo
    while a < hi:
        b = min(hi, (a // part + 1) * part)
        out.append(b - a)
        a = b
    return out


def expected_schedule(spec, n, stage, b, g, *, flavour="deepspeed", rbs=RBS, thr=THR, reuse=10**9,
                      multi_rank=True, overlap=False, bound=50_000_000, offload=False, reduce_scatter=True):
    """(op/phase) -> (calls, bytes) per optimizer step, from the ledger document (revision 2)."""
    numels = _tensors(spec)
    psi = sum(numels)
    ds = flavour == "deepspeed"
    mixed = b == 2
    e: dict[str, list[int]] = {}

    def add(key, calls, nbytes):
        c = e.setdefault(key, [0, 0])
        c[0] += calls
        c[1] += nbytes

    if stage == 0:
        calls = _pack_after(numels, 500_000_000) if ds else _buckets(numels[::-1], rbs)
        add("all_reduce/backward", calls, psi * b)
        if ds and not mixed:
            add("all_reduce/step", 1, 4)
        return e
    if stage in (1, 2):
        flat = math.ceil(psi / (2 * n)) * 2 * n
        part = flat // n
        per = 1 if stage == 1 else g
        if not ds:
            chunk = max(1, rbs // n)
            add("reduce_scatter/backward", per * math.ceil(part / chunk), per * flat * b)
        else:
            order = "forward" if stage == 1 and not overlap else "reverse"
            for lo, hi in _ranges(numels, rbs, order):
                slices = _owner_slices(lo, hi, part)
                if multi_rank:
                    add("all_reduce/backward", per * _pack_after(slices, rbs), per * (hi - lo) * b)
                else:
                    add("reduce/backward", per * len(slices), per * (hi - lo) * b)
        add("all_gather/step", 1, flat * b)
        if ds:
            if mixed:
                add("all_reduce/step", 1, 1)
            add("all_reduce/step", 1, 4)
        return e
    pad = lambda k: math.ceil(k / n) * n  # noqa: E731
    nonpers = [k for k in numels if k > thr]
    if ds and bound > 0 and sum(nonpers) < bound:
        # the model's own pre-forward fetch (first in DeepSpeed's trace, no parameters) prefetches
        # every parameter of the trace in one call; nothing is released before its last use
        add("all_gather/forward", g, g * sum(pad(k) for k in nonpers) * b)
    elif not ds or (bound <= 0 and reuse <= 0):
        # no prefetch, no reuse: every module gathers what it reads (a tied head: the embedding's
        # weight) before its forward and again before its backward; the paper: every parameter
        # once a pass (one call per owning module)
        for u in _reads(spec) if ds else _owned(spec):
            gathered = sum(pad(k) for k in u if k > thr)
            if gathered:
                add("all_gather/forward", g, g * gathered * b)
                add("all_gather/backward", g, g * gathered * b)
    else:  # a partial prefetch or a reuse window: no closed form here (tests/test_deepspeed_tied.py)
        e["gathers_open"] = [0, 0]
    # stage3.py: a bucket is flushed before the gradient that would overflow it (unpadded sizes); with
    # reduce_scatter off, one that fits is all-reduced in place (unpadded), else reduce-scattered padded
    for bucket in _bucket_lists(numels[::-1], rbs):
        if ds and not reduce_scatter and sum(bucket) <= rbs:
            add("all_reduce/backward", g, g * sum(bucket) * b)
        else:
            add("reduce_scatter/backward", g, g * sum(pad(k) for k in bucket) * b)
    pers = [k for k in numels if k <= thr]
    if pers:
        add("all_gather/step", len(pers), sum(pad(k) for k in pers) * b)
    if ds:
        add("all_reduce/step", 1, 4 if offload else 8)
    return e


def expected_states(spec, n, stage, b, thr=THR, rank=0, flavour="paper"):
    """(params, gradients, optimizer_states) bytes of ``rank``: 4/4/12 (fp32) or 2/2/12 accounting;
    DeepSpeed's fp32 stage 0 has no fp32 master (Adam's m, v only: 8 bytes per parameter).

    Stage 2's gradient partition buffer holds the WHOLE params overlapping the rank's slice of
    the flat buffer (DeepSpeed's copy_grads_in_partition, measured), so it differs by rank."""
    numels = _tensors(spec)
    psi = sum(numels)
    if stage == 0:
        return psi * b, psi * b, (8 if b == 4 and flavour == "deepspeed" else 12) * psi
    if stage in (1, 2):
        flat = math.ceil(psi / (2 * n)) * 2 * n
        part = flat // n
        lo, hi = rank * part, (rank + 1) * part
        p_lo, p_hi, off = lo, hi, 0
        for k in numels:
            if off < hi and off + k > lo:
                p_lo, p_hi = min(p_lo, off), max(p_hi, off + k)
            off += k
        return flat * b, (flat if stage == 1 else p_hi - p_lo) * b, 12 * part
    part = sum(math.ceil(k / n) for k in numels)
    pers = sum(math.ceil(k / n) * n for k in numels if k <= thr)  # whole, stored padded to a multiple of N
    return (part + pers) * b, part * b, 12 * part


def _run(rank, world, spec, runs):
    from zeroplan.bench.validate import measure_rank

    return measure_rank(rank, world, spec, runs)


def _launch(spec, n, runs):
    from zeroplan.bench.validate import _preload_dispatch
    from zeroplan.runtime.launch import spawn

    _preload_dispatch()
    return spawn(_run, n, args=(spec, runs), timeout_s=600)  # a hang bound: 2-30 s idle, 3x that under load


def _cfg(stage, precision, g=2, comm_model="deepspeed", warmup=1, **zero):
    """One run: a warm-up step (the engine's schedule is the same from its second step on), then two
    measured steps that must issue the same collectives."""
    z = dict(stage=stage, reduce_bucket_size=RBS, param_persistence_threshold=THR, overlap_comm=stage == 3)
    z.update(zero)
    return {"zero": ZeroConfig(**z), "precision": precision, "micro_batch": 2, "seq_len": 16, "grad_accum": g,
            "warmup": warmup, "steps": 2, "comm_model": comm_model, "seed": 0}


def _measured_schedule(res):
    return {k: [v["count"], v["bytes"]] for k, v in res["collectives"].items()}


def _plan(spec, run, n):
    from zeroplan.bench.validate import predict

    from zeroplan.bench.zero_predict import engine_optimizer_impl

    return predict(spec, run["zero"], precision=run["precision"], micro_batch=run["micro_batch"],
                   seq_len=run["seq_len"], grad_accum=run["grad_accum"], n=n, comm_model=run["comm_model"],
                   optimizer_impl=engine_optimizer_impl("cpu"))


def _plan_schedule(plan):
    out: dict[str, list[int]] = {}
    for e in plan.comm.collectives:
        c = out.setdefault(f"{e.op}/{e.phase}", [0, 0])
        c[0] += e.count
        c[1] += e.count * e.buffer_bytes
    return out


def _check(spec, n, run, per_rank, k, *, against_plan=True, **sched_kw):
    b = 4 if run["precision"] == "fp32" else 2
    stage = run["zero"].stage
    res = [r[k] for r in per_rank]
    assert all("oom" not in r for r in res)
    got = _measured_schedule(res[0])
    # every rank issues the same schedule, every measured step the same
    assert all(_measured_schedule(r) == got for r in res)
    assert all(r["steady"] for r in res)
    z = run["zero"]
    exp = expected_schedule(spec, n, stage, b, run["grad_accum"], flavour=run["comm_model"],
                            reuse=z.max_reuse_distance, multi_rank=z.use_multi_rank_bucket_allreduce,
                            overlap=z.overlap_comm, bound=min(z.max_live_parameters, z.prefetch_bucket_size),
                            offload=z.offload_optimizer.device != "none", reduce_scatter=z.reduce_scatter,
                            **sched_kw)
    if exp.pop("gathers_open", None):
        got_closed = {k: v for k, v in got.items() if k not in ("all_gather/forward", "all_gather/backward")}
        assert got_closed == exp, (stage, run["comm_model"])
    else:
        assert got == exp, (stage, run["comm_model"])
    plan = _plan(spec, run, n)
    if against_plan:
        assert got == _plan_schedule(plan), (stage, run["comm_model"])
    # model states: exact closed form, and within 1% of the planner
    if z.offload_optimizer.device == "none":
        for rank, r in enumerate(res):
            ms = r["model_states"]
            p, g, o = expected_states(spec, n, stage, b, rank=rank, flavour=run["comm_model"])
            if stage == 1 and run["comm_model"] == "deepspeed" and z.contiguous_gradients:
                # DeepSpeed keeps autograd's per-parameter gradients (unpadded) to the boundary; with
                # overlap_comm in one micro-step its hooks reduce them at once: the gradient partition (stage
                # 2's closed form)
                hooked = z.overlap_comm and run["grad_accum"] == 1
                g = expected_states(spec, n, 2, b, rank=rank)[1] if hooked else b * sum(_tensors(spec))
            assert (ms["params"], ms["gradients"], ms["optimizer_states"]) == (p, g, o), rank
    # the planner reports the largest rank
    for cat in ("params", "gradients", "optimizer_states"):
        pv = getattr(plan.memory, cat)
        if cat == "gradients":  # stage 2: whole params overlapping the slice, a buffer in the plan
            pv += plan.memory.buffers_detail.get("gradient_partition_whole_params", 0)
        mv = max(r["model_states"][cat] for r in res)
        assert abs(mv - pv) <= 0.01 * max(pv, 1), (stage, cat, mv, pv)
    # phase peaks within the bench's stated tolerance
    from zeroplan.bench.validate import phase_peak_tolerance

    for ph, pm in plan.memory.phases.items():
        meas = max(r["phase_peaks"][ph]["peak"] for r in res)
        assert abs(meas - pm.peak) <= phase_peak_tolerance(plan, ph) * pm.peak, (stage, ph, meas, pm.peak)
    return res


def test_world2_fp32_all_stages_both_flavours_and_options():
    spec = _spec()
    runs = [_cfg(s, "fp32") for s in range(4)]
    runs += [_cfg(s, "fp32", comm_model="paper") for s in range(4)]
    runs += [
        _cfg(3, "fp32", max_reuse_distance=0, prefetch_bucket_size=0),  # per module; all re-gathered
        _cfg(3, "fp32", prefetch_bucket_size=5000, max_reuse_distance=20000),  # chunks; some re-gathered
        _cfg(2, "fp32", overlap_comm=True),  # double-buffered ipg, async all-reduce
        _cfg(1, "fp32", use_multi_rank_bucket_allreduce=False),  # per-owner reduce
        _cfg(3, "fp32", sub_group_size=5000),  # step tiled in sub-groups
        _cfg(2, "fp32", offload_optimizer={"device": "cpu"}),
        _cfg(3, "fp32", contiguous_gradients=False, g=1),
    ]
    per_rank = _launch(spec, 2, runs)
    for k, run in enumerate(runs):
        paper12 = run["comm_model"] == "paper" and run["zero"].stage in (1, 2)
        _check(spec, 2, run, per_rank, k, against_plan=not paper12)
    # per-owner reduces: the same bytes as the all-reduce buckets, split at the partition boundary
    red = per_rank[0][11]["collectives"]["reduce/backward"]
    assert red["bytes"] == 4 * sum(_tensors(spec))
    assert red["count"] >= _buckets(_tensors(spec)[::-1], RBS)
    # the same training trajectory in every stage and schedule (fp32): ZeRO changes where
    # states live, not the maths
    ref = per_rank[0][0]["losses"]
    for k in range(1, len(runs)):
        if runs[k]["grad_accum"] == 2:  # the same batches
            assert per_rank[0][k]["losses"][0] == pytest.approx(ref[0], rel=1e-6)
            assert per_rank[0][k]["losses"] == pytest.approx(ref, rel=1e-4), k
    # offloaded optimizer states live on the host: 16 bytes per owned element (master, m, v, fp32
    # gradient; the gradient partition itself is freed after the step), none on the device
    flat = math.ceil(sum(_tensors(spec)) / 4) * 4
    assert per_rank[0][13]["model_states"]["optimizer_states"] == 0
    assert per_rank[0][13]["model_states"]["gradients"] == 0
    assert 0 <= per_rank[0][13]["host_bytes"] - 16 * flat // 2 < 64  # + a scalar


def test_world4_bf16_all_stages():
    spec = _spec()
    runs = [_cfg(s, "bf16") for s in range(4)] + [
        _cfg(3, "bf16", comm_model="paper"), _cfg(0, "bf16", g=1, comm_model="paper"),
        _cfg(2, "bf16", use_multi_rank_bucket_allreduce=False), _cfg(1, "bf16", overlap_comm=True),
        _cfg(1, "bf16", g=1, overlap_comm=True),
        _cfg(3, "bf16", max_live_parameters=0, max_reuse_distance=0),
        _cfg(3, "bf16", reduce_scatter=False)]  # the norms' buckets all-reduced, the matrices reduce-scattered
    per_rank = _launch(spec, 4, runs)
    for k, run in enumerate(runs):
        res = _check(spec, 4, run, per_rank, k)
        assert all(r["collectives"][key]["dtypes"] in (["bfloat16"], ["uint8", "float32"], ["float64"])
                   for r in res for key in r["collectives"])
    off = per_rank[0][-1]["collectives"]  # both reductions ran, and it trains as stage 3 with reduce-scatter
    assert off["all_reduce/backward"]["count"] > 0 and off["reduce_scatter/backward"]["count"] > 0
    assert per_rank[0][-1]["losses"] == pytest.approx(per_rank[0][3]["losses"], rel=1e-3)


def test_gpt2_tied_conv1d_and_moe_world2():
    """Tied embeddings (gathered once a pass in the paper flavour), Conv1D weights, learned positions,
    MoE experts."""
    gpt2 = _spec("gpt2")
    assert any(t.tied_to for t in gpt2.tensors)
    runs = [_cfg(s, "bf16") for s in (0, 2, 3)] + [_cfg(3, "bf16", comm_model="paper")]
    per_rank = _launch(gpt2, 2, runs)
    for k, run in enumerate(runs):
        _check(gpt2, 2, run, per_rank, k)
    moe = _spec("mixtral-8x7b")
    runs = [_cfg(3, "fp32", g=1), _cfg(1, "fp32", g=1)]
    per_rank = _launch(moe, 2, runs)
    for k, run in enumerate(runs):
        _check(moe, 2, run, per_rank, k)
    assert per_rank[0][0]["losses"] == pytest.approx(per_rank[0][1]["losses"], rel=1e-5)


def _reference_losses(spec, n, steps, lr=1e-3):
    """Plain torch: one process, the mean loss over the n ranks' micro-batches, torch AdamW."""
    from zeroplan.runtime.model import build_model

    model = build_model(spec, "fp32", "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(n)]
    losses = []
    for _ in range(steps):
        batches = [torch.randint(0, spec.vocab_size, (2, 16), generator=g) for g in gens]
        opt.zero_grad()
        vals = [model(b) for b in batches]
        loss = sum(vals) / n
        loss.backward()
        opt.step()
        losses.append(float(vals[0].detach()))
    return losses


def test_matches_plain_torch_adamw():
    spec = _spec()
    runs = [_cfg(s, "fp32", g=1, warmup=2) for s in (0, 3)]
    per_rank = _launch(spec, 2, runs)
    ref = _reference_losses(spec, 2, 4)  # 2 warm-up + 2 measured steps
    for k in range(len(runs)):
        assert per_rank[0][k]["losses"] == pytest.approx(ref, rel=1e-5)


def test_build_model_exact_inventory():
    from zeroplan.runtime.model import build_model

    for name in ("llama-2-7b", "gpt2", "mixtral-8x7b", "gpt-neox-20b", "falcon-7b", "phi-2", "qwen2-7b"):
        spec = _spec(name)
        model = build_model(spec, "fp32")
        named = dict(model.named_parameters())
        for t in spec.tensors:
            if t.tied_to is None:
                assert list(named[t.name].shape) == t.shape
        assert sum(p.numel() for p in model.parameters()) == spec.params
        ids = torch.randint(0, spec.vocab_size, (2, 8))
        loss = model(ids)
        loss.backward()
        assert math.isfinite(float(loss.detach()))
        assert all(p.grad is not None for p in model.parameters()), name
    # a deterministic init for a seed
    a = build_model(_spec(), "fp32", seed=3)
    b = build_model(_spec(), "fp32", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_storage_tracker_counts_storages_once_and_enforces_a_limit():
    from zeroplan.runtime.memory import SimulatedOutOfMemory, StorageTracker

    tr = StorageTracker(memory_limit_bytes=10_000)
    with tr:
        a = torch.empty(1000)  # 4000 bytes
        v = a.view(10, 100)  # a view: no new storage
        assert tr.live_bytes == 4000
        tr.tag(a, "params")
        assert tr.current_by_category()["params"] == 4000
        del a, v
        assert tr.live_bytes == 0
        keep = torch.empty(2000)  # 8000
        with pytest.raises(SimulatedOutOfMemory) as exc:
            torch.empty(1000)
        assert exc.value.live_bytes == 8000 and exc.value.requested_bytes == 4000
        del keep
    assert tr.phase_peaks()["forward"]["peak"] == 8000


def test_storage_tracker_does_not_count_meta_tensors():
    # DeepSpeed 0.19.8's ZeRO-1/2 keeps a meta-device copy of every parameter's shape
    # (stage_1_and_2.py round_robin_bit16_meta): shapes only, no memory, so no bytes
    from zeroplan.runtime.memory import StorageTracker

    tr = StorageTracker()
    with tr:
        shapes = [torch.zeros(4096, 4096, device="meta") for _ in range(3)]
        real = torch.empty(1000)
        assert tr.live_bytes == 4000
    assert len(shapes) == 3 and real.numel() == 1000


def test_train_step_takes_a_generator_and_counts_its_micro_batches():
    """A generator makes each micro-batch when the loop reaches it (the previous ids are released then, as in a
    DeepSpeed training loop); it trains as the list does, and a wrong count is refused before the optimizer
    steps."""
    from zeroplan.runtime.comm import LocalComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.model import build_model

    spec = _spec()

    def batches(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, spec.vocab_size, (1, 16), generator=gen) for _ in range(2)]

    losses = []
    for make in (list, iter):
        eng = ZeroEngine(build_model(spec, "fp32", "cpu", seed=0), ZeroConfig(stage=2), comm=LocalComm(1), grad_accum=2)
        losses.append([eng.train_step(make(batches(s)))["loss"] for s in range(2)])
        if make is iter:
            steps = eng.step_count
            with pytest.raises(ValueError, match="got 1 micro-batches, grad_accum is 2"):
                eng.train_step(iter(batches(9)[:1]))
            with pytest.raises(ValueError, match="more than 2 micro-batches"):
                eng.train_step(iter(batches(9) * 2))
            assert eng.step_count == steps
        eng.close()
    assert losses[0] == losses[1]
