"""DeepSpeed's estimator beside zeroplan's peak: the named parts of the difference add up to it,
in bytes and as printed, and the label names the DeepSpeed function that was used (DeepSpeed 0.19.8
has estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs, no ZeRO-1 one).
"""

from __future__ import annotations

import itertools
import random
import re

import pytest

from zeroplan.core.inputs import build_plan_inputs
from zeroplan.core.plan import evaluate
from zeroplan.report.render import estimator_line, rounded_parts

CASES = list(itertools.product(
    ("llama-2-7b", "llama-2-70b", "mixtral-8x7b", "gpt2"),
    ("dgx-h100", "dgx-a100-40gb"),
    (1, 64),  # GPUs
    (1, 2, 3),  # stage
    ("none", "cpu"),  # optimizer offload
    ("none", "full"),  # checkpointing
))
NUM = r"(−?[\d,]+\.\d\d)"
LINE = re.compile(rf"zeroplan's peak {NUM} − DeepSpeed's {NUM} = {NUM} GB: model states {NUM} \+ buffers {NUM} "
                  rf"\+ activations {NUM} \+ overhead {NUM}")


def _hundredths(s: str) -> int:
    return round(float(s.replace("−", "-").replace(",", "")) * 100)


@pytest.mark.parametrize("model,hw,gpus,stage,off,ckpt", CASES)
def test_difference_parts_add_up(model, hw, gpus, stage, off, ckpt):
    inp = build_plan_inputs(model=model, hardware=hw, gpus=gpus, precision="bf16", checkpointing=ckpt,
                            offload_optimizer=off, seq_len=2048)
    p = evaluate(model=inp.spec, training=inp.training, zero=inp.zero(stage), n_gpus=inp.n_gpus,
                 gpus_per_node=inp.gpus_per_node, hardware=inp.hardware)
    e = p.deepspeed_estimator
    d = e.vs_peak
    # bytes: exact
    assert d.difference_bytes == p.memory.peak - e.gpu_bytes_per_gpu
    assert d.model_states_bytes + d.buffers_bytes + d.activations_bytes + d.overhead_bytes == d.difference_bytes
    # which estimator
    assert e.estimator == ("estimate_zero3_model_states_mem_needs" if stage == 3
                           else "estimate_zero2_model_states_mem_needs")
    text = estimator_line(p)
    assert e.estimator in text and ("no ZeRO-1 estimator" in text) == (stage == 1)
    # as printed: peak − estimate = difference = sum of the parts, in hundredths of a GB
    m = LINE.search(text)
    assert m, text
    peak, est, diff, *parts = (_hundredths(x) for x in m.groups())
    assert peak == round(p.memory.peak / 1e7) and est == round(e.gpu_bytes_per_gpu / 1e7)
    assert peak - est == diff == sum(parts)
    # each printed part is its exact value to within one hundredth of a GB
    exact = [d.model_states_bytes, d.buffers_bytes, d.activations_bytes, d.overhead_bytes]
    assert all(abs(x - b / 1e7) <= 1.0 for x, b in zip(parts, exact)), (parts, exact)


def test_rounded_parts_sum_to_the_total():
    rng = random.Random(11)
    for _ in range(2000):
        parts = [rng.randrange(-10**11, 10**11) for _ in range(rng.randrange(1, 6))]
        total = sum(parts)
        shown_total = round(total / 10**7) + rng.choice((-1, 0, 1))  # e.g. peak and estimate rounded apart
        out = rounded_parts(shown_total, parts)
        assert sum(out) == shown_total
        assert all(abs(o - p / 10**7) <= 2 for o, p in zip(out, parts))
