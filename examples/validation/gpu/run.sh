#!/usr/bin/env bash
# zeroplan's GPU validation, as run on a one-GPU node: `bash examples/validation/gpu/run.sh OUTDIR`
# from the repository root. Every step has its own time limit, so one that hangs or fails keeps
# the others; each writes its report under OUTDIR and its output to OUTDIR/log.txt.
# Needs torch with CUDA, transformers, DeepSpeed (its ops build on first use: nvcc and ninja) and
# zeroplan's own dependencies. Where a wheel folder is given as $WHEELS, they are installed from it
# first (the project's device machine has no package index).
set -u
out=${1:?usage: run.sh OUTDIR}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
step() { local limit=$1; shift; echo "== $(date -u +%H:%M:%S) $*"; timeout "$limit" "$@"; echo "== exit $?"; }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/zp . || exit 1
export PYTHONPATH=/tmp/zp:${PYTHONPATH:-}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
python3 -c 'import sys, torch, transformers, deepspeed; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)'
nvcc --version | tail -1

zp() { python3 -m zeroplan "$@"; }
# every check, at the default shapes (micro-batch 1, sequence 512, 2 layers at full width)
step 330 zp validate --output "$out/llama-2-7b" --model llama-2-7b --gpus 8 --hardware hgx-h200
# the compute model at training shapes: isolated GEMMs, attention, the model's own step
for shape in "llama-2-7b 1 2048" "llama-2-7b 4 4096" "llama-3-8b 2 4096" "llama-2-13b 1 4096" "gpt2 8 1024"; do
  set -- $shape
  step 60 zp validate --output "$out/compute-$1-b$2-s$3" --model "$1" --micro-batch "$2" --seq-len "$3" \
    --layers 4 --hardware hgx-h200 --checks gemm,compute,activations
done
# the bundled engine on CUDA with NCCL (one rank): CUDA meter, CUDA-event timing
step 120 zp bench zero --model llama-2-7b --nproc 1 --stage 3 --precision bf16 --hidden 1024 --layers 2 \
  --hardware hgx-h200 --output "$out/bench-zero.json"
