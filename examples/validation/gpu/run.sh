#!/usr/bin/env bash
# zeroplan's GPU validation, as run on a one-GPU node: `bash examples/validation/gpu/run.sh OUTDIR`
# from the repository root. Every step has its own time limit, so one that hangs or fails keeps
# the others; each writes its report under OUTDIR and its output to OUTDIR/log.txt.
# Needs torch with CUDA, transformers, DeepSpeed (its ops build on first use: nvcc and ninja) and
# zeroplan's own dependencies. Where a wheel folder is given as $WHEELS, they are installed from it
# first (the project's device machine has no package index).
set -u
out=${1:?usage: run.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
exec > >(tee -a "$out/log.txt") 2>&1
# DeepSpeed 0.19.8's JIT builder cannot read an arch suffix (the machine's image sets 9.0a): plain 9.0
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
step() { local limit=$1; shift; echo "== $(date -u +%H:%M:%S) $*"; timeout "$limit" "$@"; echo "== exit $?"; }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/zp . || exit 1
export PYTHONPATH=/tmp/zp:${PYTHONPATH:-}
repo=$(pwd)
cd /tmp  # python -m puts the working directory first on sys.path: run the installed copy, not the checkout

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
python3 -c 'import sys, torch, transformers, deepspeed; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)'
nvcc --version | tail -1

zp="python3 -m zeroplan"  # a command timeout can run (not a shell function)
# every check at the default shapes (micro-batch 1, sequence 512, 2 layers at full width), in parts
# with their own limits: DeepSpeed's FusedAdam and cpu_adam ops are built on first use
v7="--model llama-2-7b --gpus 8 --hardware hgx-h200"
step 150 $zp validate --output "$out/llama-2-7b-forked" $v7 --checks multi-gpu,cpu-adam
step 200 $zp validate --output "$out/llama-2-7b" $v7 --checks context,optimizer,activations,gemm,compute,engine,pcie
step 150 $zp validate --output "$out/llama-2-7b-deepspeed" $v7 --checks deepspeed
# DeepSpeed's stage-3 module hooks with CUDA's stream, event and launch calls real (core/host_time.py's
# constants were measured on CPU, a lower bound): 16 short DeepSpeed runs on tiny models
step 400 python3 "$repo/examples/validation/stage3-host/measure.py" --device cuda --output "$out/stage3-host-cuda.json"
# the compute model at training shapes: isolated GEMMs, attention, the model's own step
for shape in "llama-2-7b 1 2048" "llama-2-7b 4 4096" "llama-3-8b 2 4096" "llama-2-13b 1 4096" "gpt2 8 1024" \
             "llama-2-7b 1 8192" "llama-2-7b 16 512"; do
  set -- $shape
  [ -e "$out/compute-$1-b$2-s$3/validation.json" ] && continue
  step 60 $zp validate --output "$out/compute-$1-b$2-s$3" --model "$1" --micro-batch "$2" --seq-len "$3" \
    --layers 4 --hardware hgx-h200 --checks gemm,compute,activations
done
# and every check in one process, in validate's own order
step 300 $zp validate --output "$out/llama-2-7b-all" $v7
