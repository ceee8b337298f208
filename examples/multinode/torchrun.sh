#!/usr/bin/env bash
# Two nodes x 8 GPUs, NCCL: measure the links, then run real ZeRO steps against the plan.
# Run this script on EVERY node, with NODE_RANK=0 on the first and NODE_RANK=1 on the second:
#
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 ./torchrun.sh      # on node 0 (its address is MASTER_ADDR)
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 ./torchrun.sh      # on node 1
#
# Static rendezvous (--node-rank) keeps ranks 0-7 on node 0 and 8-15 on node 1, which is the
# contiguous layout zeroplan's intra-node / inter-node groups assume. Only global rank 0
# prints and writes files.
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NODE_RANK:?set NODE_RANK to 0 or 1}"
MASTER_PORT="${MASTER_PORT:-29500}"      # any free TCP port on node 0, the same on both nodes
NNODES="${NNODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
HARDWARE="${HARDWARE:-dgx-h100}"          # base profile: zeroplan profiles list
BACKEND="${BACKEND:-nccl}"               # gloo for a CPU dry run
OUT="${OUT:-zeroplan-results}"
mkdir -p "$OUT"

launch() {
  torchrun --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" --node-rank="$NODE_RANK" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" -m zeroplan "$@"
}

# 1. Bus bandwidth inside a node (NVLink / PCIe), 8 B .. 1 GiB, as nccl-tests reports it.
launch bench collectives --backend "$BACKEND" --group intra --min-bytes 8 --max-bytes 1G \
  --output "$OUT/collectives-intra.json"

# 2. Across nodes (NIC): ranks with the same local rank, and a calibrated profile from the fit
#    (alpha = latency, beta = bus bandwidth per GPU; other fields come from $HARDWARE).
launch bench collectives --backend "$BACKEND" --group inter --min-bytes 8 --max-bytes 1G \
  --save-profile "$OUT/measured-inter.toml" --hardware "$HARDWARE" --output "$OUT/collectives-inter.json"

# 3. The whole world (what a ZeRO all-gather / reduce-scatter over 16 GPUs sees).
launch bench collectives --backend "$BACKEND" --group all --ops all_gather,reduce_scatter,all_reduce \
  --max-bytes 1G --output "$OUT/collectives-all.json"

# 4. Real ZeRO steps, stages 1-3, on a scaled-down Llama shape: predicted vs measured collectives
#    and memory; exits 1 when a figure is outside the tolerance.
launch bench zero --backend "$BACKEND" --model llama-2-7b --stage 1,2,3 --precision bf16 \
  --hardware "$HARDWARE" --output "$OUT/bench-zero.json"
