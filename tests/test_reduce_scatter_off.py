"""Stage 3 with ``reduce_scatter: false`` (the ZeRO++ tutorial's config), as DeepSpeed 0.19.8 runs it.

``stage3.py`` ``__reduce_and_partition_ipg_grads``: with contiguous gradients, a bucket that fits
``reduce_bucket_size`` is all-reduced in place (``__avg_scatter_contiguous_grads``: its unpadded elements),
then post-scaled out of place by ``gradient_predivide_factor`` (a copy of the bucket on more than one rank;
measured on real DeepSpeed, tests/test_backward_moments.py); a lone gradient larger than the bucket is still reduce-scattered (padded per gradient), and qgZ
replaces only that reduce-scatter. Buckets are cut before a gradient that would overflow them, on the
unpadded sizes (``bucket.elements + param.ds_numel > reduce_bucket_size``). The expected buckets and bytes
below are written out from those rules; real DeepSpeed issues the same calls (tests/test_deepspeed_engine.py,
``reduce_scatter=False`` cases) and so does the bundled engine (tests/test_engine.py).
"""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from zeroplan.bench.validate import scaled_spec
from zeroplan.cli import app
from zeroplan.core.grad_buckets import ready_buckets, stage3_all_reduced, stage3_flush_temp_elements
from zeroplan.core.layout import Layout, Tensor
from zeroplan.core.plan import evaluate
from zeroplan.specs.deepspeed_config import ZeroConfig
from zeroplan.specs.model import load_model
from zeroplan.specs.training import TrainingSetup, get_precision

RBS = 3000


def _spec():
    return scaled_spec(load_model("llama-2-7b"), layers=2, hidden=64, vocab=130)


def _plan(n, gpn=8, **zero):
    training = TrainingSetup(precision=get_precision("bf16"), micro_batch=1, seq_len=16, grad_accum=1)
    return evaluate(model=_spec(), training=training, zero=ZeroConfig(stage=3, reduce_bucket_size=RBS, **zero),
                    n_gpus=n, gpus_per_node=gpn)


def _expected_buckets(numels, cap):
    out, cur = [], []
    for k in reversed(numels):  # gradient-ready order
        if cur and sum(cur) + k > cap:
            out.append(cur)
            cur = []
        cur.append(k)
    return out + [cur]


def _numels():
    return [t.numel for t in _spec().tensors if t.tied_to is None]


def test_buckets_are_cut_on_unpadded_sizes():
    # 49 + 51 = 100 elements fit a 100-element bucket; padded to multiples of 4 (52 + 52) they would not
    lay = Layout(params=100, n=4, tensors=[Tensor("a", "m0", 51, 0), Tensor("b", "m0", 49, 0)])
    flushes, last = ready_buckets(lay, 100)
    assert (flushes, last) == ([], [49, 51])
    assert stage3_all_reduced(last, 100, reduce_scatter=False, contiguous=True)
    assert not stage3_all_reduced(last, 100, reduce_scatter=True, contiguous=True)
    assert not stage3_all_reduced(last, 100, reduce_scatter=False, contiguous=False)
    # the all-reduce is in place but its post-scale copies the unpadded bucket (not on one rank); the
    # reduce-scatter interleaves a padded copy, except a lone gradient that divides evenly
    assert stage3_flush_temp_elements(last, 4, 100, reduce_scatter=False, contiguous=True) == 100
    assert stage3_flush_temp_elements(last, 1, 100, reduce_scatter=False, contiguous=True) == 0
    assert stage3_flush_temp_elements(last, 4, 100, reduce_scatter=True, contiguous=True) == 104
    assert stage3_flush_temp_elements([400], 4, 100, reduce_scatter=False, contiguous=True) == 0
    assert stage3_flush_temp_elements([401], 4, 100, reduce_scatter=False, contiguous=True) == 404


def test_ledger_all_reduces_the_buckets_that_fit_and_reduce_scatters_the_rest():
    n = 8
    buckets = _expected_buckets(_numels(), RBS)
    fit = [b for b in buckets if sum(b) <= RBS]
    big = [b for b in buckets if sum(b) > RBS]
    assert fit and big and all(len(b) == 1 for b in big)  # the norms' buckets and the lone matrices
    plan = _plan(n, reduce_scatter=False)
    got = {}
    for e in plan.comm.collectives:
        if e.phase == "backward" and e.op != "all_gather":
            got.setdefault(e.op, []).extend([e.buffer_bytes] * e.count)
    assert sorted(got["all_reduce"]) == sorted(2 * sum(b) for b in fit)  # unpadded, bf16
    assert sorted(got["reduce_scatter"]) == sorted(2 * math.ceil(b[0] / n) * n for b in big)
    assert any("reduce_scatter is off" in note for note in plan.notes)
    on = _plan(n)
    rs_on = [e for e in on.comm.collectives if e.phase == "backward" and e.op == "reduce_scatter"]
    assert sum(e.count for e in rs_on) == len(buckets)
    # an all-reduce sends twice what a reduce-scatter of the same buffer sends (ring: 2(N-1)/N vs (N-1)/N)
    assert plan.comm.bytes_per_gpu_per_step > on.comm.bytes_per_gpu_per_step


def test_qgz_quantises_only_what_is_reduce_scattered():
    plan = _plan(16, gpn=8, reduce_scatter=False, zero_quantized_gradients=True)
    ops = {e.op for e in plan.comm.collectives if e.phase == "backward" and e.op != "all_gather"}
    assert ops == {"all_reduce", "all_to_all"}
    assert any("qgZ does not quantise" in note for note in plan.notes)


def test_memory_holds_the_post_scale_copy_not_an_interleaved_one():
    # every lone matrix here divides by 8, so with reduce_scatter off the only copies are the all-reduced
    # buckets' post-scaled ones (unpadded): the largest bucket that fits
    assert all(k % 8 == 0 for k in _numels() if k > RBS)
    fit = [sum(b) for b in _expected_buckets(_numels(), RBS) if sum(b) <= RBS]
    off, on = _plan(8, reduce_scatter=False), _plan(8)
    assert off.memory.buffers_detail["reduce_scatter_temp"] == 2 * max(fit) < 2 * RBS
    assert on.memory.buffers_detail["reduce_scatter_temp"] == 2 * RBS


def test_check_warns_and_evaluates_turning_reduce_scatter_back_on(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "reduce_scatter": False, "zero_quantized_gradients": True}}
    path = tmp_path / "zeropp-tutorial.json"
    path.write_text(json.dumps(cfg))
    args = ["check", str(path), "-m", "llama-2-7b", "-H", "h100-8x-ib400", "--nodes", "2", "--format", "json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code in (0, 1), r.output
    (f,) = json.loads(r.stdout)["files"]
    (zp,) = [x for x in f["findings"] if x["rule_id"] == "ZP205"]
    assert zp["severity"] == "warning" and "qgZ does not quantise" in zp["message"]
    assert zp["key"] == "zero_optimization.reduce_scatter"
    (alt,) = zp["alternatives"]
    assert alt["change"] == {"reduce_scatter": True} and alt["after"] < alt["before"]
    # the tutorial's own 1e7 buckets: every matrix of a 7B model is a lone bucket larger than that, so
    # only the norms' buckets are all-reduced (under 5% of the bytes): nothing worth a warning
    for change in ({"reduce_bucket_size": 10_000_000}, {"reduce_scatter": True}):
        cfg["zero_optimization"].update(change)
        path.write_text(json.dumps(cfg))
        r = CliRunner().invoke(app, args)
        assert "ZP205" not in {x["rule_id"] for x in json.loads(r.stdout)["files"][0]["findings"]}
