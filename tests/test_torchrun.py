"""Two torchrun "nodes" on loopback (static rendezvous, gloo): the multi-node path end to end.

Each launch takes ~20-35 s on 2 cores (torchrun + 2 ranks importing torch per node).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # torchrun is run as `python -m torch.distributed.run` (same launcher)

# A bound on hangs, not on speed: one launch takes 20-35 s on an idle 2-core machine, 2-3x that
# under load; the ranks' own --timeout (process-group and rendezvous) is as generous.
HARD_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, *zeroplan_args: str) -> tuple[list[subprocess.CompletedProcess], str]:
    """Start node 0 and node 1 (2 ranks each) and wait for both; returns (results, stdout of node 0)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    procs = []
    outs = []
    for node in (0, 1):
        out = open(tmp_path / f"node{node}.out", "w+")  # noqa: SIM115
        err = open(tmp_path / f"node{node}.err", "w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "zeroplan", *zeroplan_args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True))
        outs.append((out, err))
    try:
        for p in procs:
            p.wait(timeout=HARD_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    results = []
    for p, (out, err) in zip(procs, outs):
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results, results[0].stdout


def test_bench_collectives_across_two_torchrun_nodes(tmp_path):
    results, stdout0 = _two_nodes(
        tmp_path, "bench", "collectives", "--json", "--backend", "gloo", "--group", "inter",
        "--ops", "all_reduce,all_gather", "--min-bytes", "1K", "--max-bytes", "16K", "--factor", "4",
        "--iters", "3", "--warmup", "1", "--timeout", "300",
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert results[1].stdout.strip() == ""  # only rank 0 (on node 0) reports
    data = json.loads(stdout0)
    assert data["launcher"] == "torchrun"
    assert data["world_size"] == 4 and data["nodes"] == 2 and data["gpus_per_node"] == 2
    # node of each rank as torchrun placed it (GROUP_RANK), matching a 2-GPU-per-node profile
    assert [(r["rank"], r["node"], r["local_rank"]) for r in data["ranks"]] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert data["groups"]["intra-node"] == [[0, 1], [2, 3]]
    assert data["groups"]["inter-node"] == [[0, 2], [1, 3]]
    sizes = [1024, 4096, 16384]
    assert [(r["op"], r["size_bytes"]) for r in data["results"]] == [(op, s) for op in ("all_reduce", "all_gather")
                                                                      for s in sizes]
    for r in data["results"]:
        assert r["group"] == "inter-node" and r["group_size"] == 2 and len(r["rank_time_s"]) == 4
        assert r["records"]["buffer_bytes"] == r["size_bytes"] and r["records"]["count"] == 3
        factor = 1.0 if r["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n = 2
        assert r["busbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9 * factor, rel=1e-12)


def test_bench_zero_stage3_across_two_torchrun_nodes(tmp_path):
    results, stdout0 = _two_nodes(tmp_path, "bench", "zero", "--model", "gpt2", "--stage", "3", "--json",
                                  "--backend", "gloo", "--timeout", "300")
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert results[1].stdout.strip() == ""
    data = json.loads(stdout0)
    assert data["world_size"] == 4
    assert data["ok"] is True, json.dumps(data.get("findings"))[:2000]
    assert [s["stage"] for s in data["stages"]] == [3]
