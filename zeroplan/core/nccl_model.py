"""Collective time as NCCL's tuner predicts it: latency + size / bandwidth for every
algorithm × protocol the hardware has, and the fastest one wins.

Structure follows NCCL's ``src/graph/tuning.cc`` (``ncclTopoTuneModel`` builds a latency and
a bandwidth per collective × algorithm × protocol; ``ncclTopoGetAlgoTime`` returns
``lat + bytes / (1000 · bw)``; the enqueue path picks the smallest time):
- latency = base latency (algorithm, protocol) + hops × per-hop latency of the transport:
  ring: (steps − inter-node steps) intra hops + inter-node steps network hops; tree:
  2 · ((ranks per node − 1) intra hops + log2(nodes) network hops); NVLS / CollNet: one NVLS
  or network hop plus the intra chain. ``BASE_LAT_US`` / ``HOP_LAT_US`` hold NCCL's
  constants (NCCL 2.19+: baseLat, hwLat for NVLink, PCI and NET). The profile's
  ``latency_us`` rescales NCCL's per-hop table of its tier: it is the Simple-protocol ring hop
  (NCCL: NVLink 3.4 µs, PCI 5.7 µs, NET 14 µs), so a fitted α or a slow transport (EFA,
  TCP) scales every protocol's hop by the same ratio.
- bandwidth: the ring's bus bandwidth is the link tier's (or, across nodes, the slower of
  NVLink and the node's NICs); LL carries 8 data bytes per 16 (NCCL: ×1/4 for rings crossing
  nodes or all-reducing, ×1/3 otherwise), LL128 120 of 128 (×0.92); the tree's bus bandwidth
  is 0.9 × the ring's (its inter-node traffic per GPU is half a ring's at two nodes, which is
  why a two-node tree beats the ring bound); NVLS reduces inside the NVSwitch, so each GPU
  sends and receives the buffer once: algbw = NVLink bandwidth × ``NVLS_EFFICIENCY``.
- per-size efficiency: NCCL's ``treeCorrectionFactor`` (tree, 64 B – 128 MB) and the ring
  Simple "plateau" (latency × 1.9 for multi-node all-reduce of ≥ ranks/16 × 64 KiB) are
  applied as NCCL applies them.
Group topology: a group inside one node of k GPUs on a full mesh (MI300X xGMI:
``mesh_link_GBps`` per pair) gets (k − 1) links, not the 8-GPU figure; PCIe groups use the PCIe
tier; groups across nodes use every NIC of the node that holds a member (multi-NIC).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from zeroplan.core.compute import gpu_generation
from zeroplan.specs.collectives import busbw_factor

__all__ = ["AlgoChoice", "collective_choice", "ALGORITHMS", "PROTOCOLS", "NVLS_EFFICIENCY"]

ALGORITHMS = ("ring", "tree", "collnet", "nvls", "nvls_tree")
PROTOCOLS = ("LL", "LL128", "Simple")
# NCCL tuning.cc baseLat [algo][LL, LL128, Simple] (µs); NVLS and NVLSTree carry 23 µs (NCCL 2.19+)
BASE_LAT_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "collnet": (0.0, 0.0, 0.0),
               "nvls": (0.0, 0.0, 23.0), "nvls_tree": (0.0, 0.0, 23.0)}
# NCCL tuning.cc hwLat [NVLINK | PCI | NET][algo][LL, LL128, Simple] (µs per hop); 0 = unsupported
HOP_LAT_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet": (0.0, 0.0, 3.7),
               "nvls": (0.0, 0.0, 25.0), "nvls_tree": (0.0, 0.0, 25.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet": (0.0, 0.0, 3.7),
            "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet": (0.0, 0.0, 31.0),
            "nvls": (0.0, 0.0, 18.0), "nvls_tree": (0.0, 0.0, 14.0)},
}
_RING_SIMPLE_HOP = {"nvlink": 3.4, "pci": 5.7, "net": 14.0}
# NCCL tuning.cc treeCorrectionFactor[proto][log2(bytes/64)], 64 B .. 128 MB
_TREE_CORR = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
# NVLS all-reduce: bus bandwidth 476 GB/s measured on 8× H100 SXM (nccl-tests issue #290,
# NVIDIA/nccl-tests, AddyLaddy 2025-03-03: "NVLink SHARP ... 476GB/s looks to be in the expected
# range") = algbw 272 GB/s = 0.60 of 450 GB/s per direction.
NVLS_EFFICIENCY = 0.60
_LL128_MAX_GBPS = 0.92  # fraction (NCCL: busBw × 120/128 ≈ 0.92)
# Network pipeline fill (per-size efficiency across nodes). NCCL moves a channel's data through a
# FIFO of NCCL_STEPS slots of NCCL_BUFFSIZE (default 4 MiB, src/include/comm.h DEFAULT_BUFFSIZE) per
# peer; the proxy thread posts a network send only once a slot is full (src/transport/net.cc,
# sendProxyProgress), so until every channel's FIFO is primed the GPU-side copy/reduction and the
# wire do not overlap: the first ``NET_PIPELINE_BYTES_PER_NIC`` bytes each NIC sends cost about
# twice. Two channels per NIC (NCCL's default of 2 channels per NIC on multi-node graphs,
# src/graph/search.cc) × 4 MiB = 8 MiB. The cost saturates: a call of any size pays at most
# 8 MiB / (one NIC's bandwidth), and a small call pays its own bandwidth time again. NICs per
# node come from the profile (``inter_node.nics_per_node``; default one per GPU).
NET_PIPELINE_BYTES_PER_NIC = 2 * 4 * 2**20
# NCCL tuning.cc llMaxBws[generation][1 node, 2 nodes, > 2 nodes]: the LL protocol's bus
# bandwidth cap (GB/s), whatever the links (LL spins on 8-byte flag+data words, so its rate is
# bound by the GPU's polling, not the wire). NCCL 2.19+ values; Ada/CDNA use the Ampere row.
LL_MAX_BUSBW_GBPS = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0)}


class AlgoChoice(BaseModel):
    algorithm: str
    protocol: str
    time_s: float
    latency_s: float
    busbw_GBps: float  # bus bandwidth this call reaches (nccl-tests convention)


def _tier_kind(link: Any, inter: bool) -> str:
    if inter:
        return "net"
    name = link.name.lower()
    return "pci" if ("pcie" in name and "nvlink" not in name) else "nvlink"


def _algorithms(link: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    algos = getattr(link, "algorithms", None)
    return tuple(algos) if algos else default


def _intra_bw_Bps(intra: Any, k: int, gpn: int) -> float:
    """Achievable per-GPU bandwidth of a ring over k GPUs of one node."""
    mesh = getattr(intra, "mesh_link_GBps", None)
    if mesh and k < gpn:
        # full mesh (xGMI): a group of k GPUs uses k−1 of each GPU's links
        return mesh * 1e9 * max(1, k - 1) * intra.efficiency
    return intra.bandwidth_GBps_per_gpu * 1e9 * intra.efficiency


def _hop_lat(kind: str, link: Any, algo: str, proto: int) -> float:
    base = HOP_LAT_US[kind][algo][proto]
    return base * (link.latency_us / _RING_SIMPLE_HOP[kind])


def collective_choice(op: str, nbytes: int, n: int, nodes: int, gpn_in_group: int, hw: Any,
                      *, all_gpus_per_node: int | None = None) -> AlgoChoice:
    """Fastest algorithm × protocol for one call of ``op`` on ``nbytes`` (full buffer) over
    ``n`` ranks on ``nodes`` nodes (``gpn_in_group`` ranks per node)."""
    intra, inter = hw.intra_node, hw.inter_node
    gpn_all = all_gpus_per_node or hw.node.gpus_per_node
    multi = nodes > 1
    kind_i = _tier_kind(intra, False)
    bw_intra = _intra_bw_Bps(intra, gpn_in_group, gpn_all)
    if multi:
        nic = inter.bandwidth_GBps_per_gpu * 1e9 * inter.efficiency
        per_node = nic * (1 if op == "all_to_all" else gpn_in_group)
        ring_bw = min(bw_intra, per_node) if gpn_in_group > 1 else nic
        # tree: two nodes exchange half a ring's inter-node traffic (NCCL uses speedIntra at ≤ 2 nodes)
        tree_bw = 0.9 * min(bw_intra, (2.0 if nodes <= 2 else 1.0) * per_node)
    else:
        ring_bw = bw_intra
        tree_bw = 0.9 * bw_intra
    factor = busbw_factor(op, n)
    steps = 2 * (n - 1) if op == "all_reduce" else (n - 1 if op in ("all_gather", "reduce_scatter", "all_to_all") else n)
    inter_steps = 0 if not multi else (2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
    intra_algos = set(_algorithms(intra, ("ring", "tree")))
    inter_algos = set(_algorithms(inter, ("ring", "tree")))
    if multi:
        algos = inter_algos & {"ring", "tree", "collnet"}
        if "nvls" in intra_algos and "tree" in inter_algos:
            algos.add("nvls_tree")
    else:
        algos = intra_algos & {"ring", "tree", "nvls"}
    gen = gpu_generation(hw.gpu.name)
    best: tuple[float, float, str, str] | None = None  # (time, latency, algorithm, protocol); one model at the end
    log_size = int(math.log2(max(1, nbytes >> 6))) if nbytes >= 64 else 0
    for algo in sorted(algos):
        if algo != "ring" and op != "all_reduce" and not (algo == "nvls" and op in ("all_gather", "reduce_scatter")):
            continue  # NCCL: only ring for the other collectives (NVLS also all-gather/reduce-scatter)
        for p, proto in enumerate(PROTOCOLS):
            if algo in ("nvls", "nvls_tree", "collnet") and proto != "Simple":
                continue
            if proto == "LL128" and kind_i == "pci":
                continue  # NCCL enables LL128 only over NVLink
            lat = BASE_LAT_US[algo][p]
            hi = _hop_lat(kind_i, intra, algo, p) * (1.8 if (multi and proto == "LL") else 1.0)
            hn = _hop_lat("net", inter, algo, p)
            if algo == "ring":
                lat += (steps - inter_steps) * hi + inter_steps * hn
                # NCCL: the ring's per-byte cost is the bus bandwidth with the busbw factor
                bw = ring_bw
                eff_factor = factor
            elif algo == "tree":
                lat += 2 * ((gpn_in_group - 1) * hi + (math.log2(nodes) if multi else 0) * hn)
                bw = tree_bw * (_TREE_CORR[proto][log_size] if log_size < 22 else 1.0)
                eff_factor = factor
            elif algo == "nvls":
                lat += HOP_LAT_US["nvlink"]["nvls"][2]
                bw = intra.bandwidth_GBps_per_gpu * 1e9 * NVLS_EFFICIENCY
                eff_factor = 1.0 if op == "all_reduce" else (n - 1) / n
            else:  # nvls_tree / collnet: NVLS or chain inside, tree or SHARP across nodes
                lat += HOP_LAT_US["nvlink"][algo if algo != "collnet" else "collnet"][2] + hn
                nic = inter.bandwidth_GBps_per_gpu * 1e9 * inter.efficiency
                inner = intra.bandwidth_GBps_per_gpu * 1e9 * (NVLS_EFFICIENCY if algo == "nvls_tree" else 0.9 * intra.efficiency)
                # each GPU all-reduces its 1/gpn slice across nodes: once each way at two nodes, twice beyond
                bw = min(inner, nic * gpn_in_group / (2.0 if nodes > 2 else 1.0))
                eff_factor = 1.0
            if proto == "LL":
                bw *= 0.25 if (multi or op == "all_reduce") else 1 / 3
                cap = LL_MAX_BUSBW_GBPS.get(gen, LL_MAX_BUSBW_GBPS["ampere"])[min(nodes, 3) - 1] * 1e9
                bw = min(bw, cap)  # ring/tree: bw is the bus bandwidth here
            elif proto == "LL128":
                bw *= _LL128_MAX_GBPS
            if algo == "ring" and proto == "Simple" and multi and op == "all_reduce" and nbytes >= n / 16 * 65536:
                lat *= 1.9  # NCCL: "plateau effect of ring"
            t_bw = nbytes * eff_factor / bw
            if multi:
                nics = getattr(inter, "nics_per_node", None) or gpn_all
                nic_Bps = inter.bandwidth_GBps_per_gpu * 1e9 * inter.efficiency * gpn_all / nics
                t_bw += min(t_bw, NET_PIPELINE_BYTES_PER_NIC / nic_Bps)
            t = lat * 1e-6 + t_bw
            if best is None or t < best[0]:
                best = (t, lat * 1e-6, algo, proto)
    assert best is not None
    t, lat_s, algo, proto = best
    return AlgoChoice(algorithm=algo, protocol=proto, time_s=t, latency_s=lat_s,
                      busbw_GBps=nbytes * factor / t / 1e9 if t > 0 else 0.0)
