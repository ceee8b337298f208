#!/usr/bin/env bash
# zeroplan's GPU validation, as run on a one-GPU node: `bash examples/validation/gpu/run.sh OUTDIR [PART...]`
# from the repository root. PARTs (default: all, in this order):
#   transformers  real DeepSpeed on transformers' own models, rank 0 of a virtual job (hf_deepspeed.py)
#   host          DeepSpeed's stage-3 module hooks on CUDA (examples/validation/stage3-host/measure.py)
#   validate      `zeroplan validate`, every check, on Llama-2-7B
#   compute       the compute model at training shapes (isolated GEMMs, attention, the model's own step)
# Every step has its own time limit, so one that hangs or fails keeps the others; each writes its report
# under OUTDIR and its output to OUTDIR/log.txt.
# Needs torch with CUDA, transformers, DeepSpeed (its ops build on first use for `validate`: nvcc and ninja)
# and zeroplan's own dependencies. Where a wheel folder is given as $WHEELS, they are installed from it
# first (the project's device machine has no package index).
set -u
out=${1:?usage: run.sh OUTDIR [transformers|host|validate|compute ...]}
shift
parts=${*:-transformers host validate compute}
mkdir -p "$out" && out=$(cd "$out" && pwd)
exec > >(tee -a "$out/log.txt") 2>&1
# DeepSpeed 0.19.8's JIT builder cannot read an arch suffix (the machine's image sets 9.0a): plain 9.0
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
step() { local limit=$1; shift; echo "== $(date -u +%H:%M:%S) $*"; timeout "$limit" "$@"; echo "== exit $?"; }
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/zp . || exit 1
export PYTHONPATH=/tmp/zp:${PYTHONPATH:-}
repo=$(pwd)
cd /tmp  # python -m puts the working directory first on sys.path: run the installed copy, not the checkout

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
python3 -c 'import sys, torch, transformers, deepspeed; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)' || exit 1
nvcc --version | tail -1
zp="python3 -m zeroplan"  # a command timeout can run (not a shell function)

if has transformers; then
  hf="python3 $repo/examples/validation/gpu/hf_deepspeed.py"
  mkdir -p "$out/transformers"
  # the CPU replays' twins (examples/validation/cpu-replay/peak-live-hf-*): 2 layers at hidden 1024, rank 0 of 8,
  # 1 x 512 tokens; memory only, so four at a time (each process has its own allocator statistics)
  twins=("llama-3-8b 3" "llama-3-8b 2" "mixtral-8x7b 3" "mixtral-8x7b 2" "gpt2 3" "gpt2 2" "falcon-7b 3" "qwen2-7b 3")
  # (a plain `wait` would wait for the log's tee too: bash waits for the last process substitution)
  pids=()
  for t in "${twins[@]}"; do
    set -- $t
    step 120 $hf "$1" "$2" 1 512 "$out/transformers/h1024-$1-stage$2.json" --hidden 1024 --world 8 --steps 3 &
    pids+=($!)
    [ ${#pids[@]} -eq 4 ] && { wait "${pids[@]}"; pids=(); }
  done
  step 120 $hf mixtral-8x7b 3 1 512 "$out/transformers/h1024-mixtral-8x7b-stage3-ckpt.json" --hidden 1024 --checkpointing full --steps 3 &
  pids+=($!)
  wait "${pids[@]}"
  # full width, 2 decoder layers, rank 0 of 16, 1 x 4096 tokens: memory and time, one at a time
  for t in "mixtral-8x7b 3 full" "llama-3-8b 3 full" "mixtral-8x7b 3 none" "llama-3-8b 2 none"; do
    set -- $t
    step 150 $hf "$1" "$2" 1 4096 "$out/transformers/full-$1-stage$2-ckpt$3.json" --world 16 --checkpointing "$3" --steps 5
  done
fi

if has host; then
  # DeepSpeed's stage-3 module hooks with CUDA's stream, event and launch calls real (core/host_time.py's
  # constants were measured on CPU, a lower bound): 16 short DeepSpeed runs on tiny models
  step 400 python3 "$repo/examples/validation/stage3-host/measure.py" --device cuda --output "$out/stage3-host-cuda.json"
fi

if has validate; then
  # every check at the default shapes (micro-batch 1, sequence 512, 2 layers at full width), in parts
  # with their own limits: DeepSpeed's FusedAdam and cpu_adam ops are built on first use
  v7="--model llama-2-7b --gpus 8 --hardware hgx-h200"
  step 150 $zp validate --output "$out/llama-2-7b-forked" $v7 --checks multi-gpu,cpu-adam
  step 200 $zp validate --output "$out/llama-2-7b" $v7 --checks context,optimizer,activations,gemm,compute,engine,pcie
  step 150 $zp validate --output "$out/llama-2-7b-deepspeed" $v7 --checks deepspeed
fi

if has compute; then
  # the compute model at training shapes: isolated GEMMs, attention, the model's own step
  for shape in "llama-2-7b 1 2048" "llama-2-7b 4 4096" "llama-3-8b 2 4096" "llama-2-13b 1 4096" "gpt2 8 1024" \
               "llama-2-7b 1 8192" "llama-2-7b 16 512" "mixtral-8x7b 1 4096"; do
    set -- $shape
    step 60 $zp validate --output "$out/compute-$1-b$2-s$3" --model "$1" --micro-batch "$2" --seq-len "$3" \
      --layers 4 --hardware hgx-h200 --checks gemm,compute,activations
  done
fi
