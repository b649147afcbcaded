#!/usr/bin/env bash
# What a machine with a CUDA GPU should run first, in one command that fits one lent GPU run
# (10 minutes a command, 8 files back): from the repository root,
#   OUT=/some/dir bash experiments/gpu_check.sh        # OUT defaults to ./gpu_check_out
# Steps, in order of value, within GPU_CHECK_BUDGET seconds (default 540) in all:
#   versions     python, jax, jaxlib, devices, nvidia-smi
#   gpu-tests    the `gpu`-marked tests (compiled Pallas kernels and the engine against the references)
#   bench-kernel paged against contiguous decode attention, and the bandwidth reached
#   engine       the engine's greedy tokens and tokens/s per backend and dtype (gpu_engine_check.py)
#   throughput   a short ShareGPT-like throughput run with --attention-backend pallas
#   hf-throughput the same requests through Hugging Face generate on torch's GPU (static batches of 32,
#                bfloat16): the paper's baseline beside the line above
#   profile-step where a step's time goes (profile_gpu_step.py): the engine's split, the bytes copied
#                each way, the trace's device kernels and host events per kind, greedy and sampled
# With no GPU every step still runs, on the CPU and small (the GPU tests only collected), and the
# report says "skipped: no GPU" beside each GPU figure: the script is tested before a GPU sees it
# (tests/test_gpu_check.py). Writes $OUT/gpu_report.md (first, and after every step) and
# $OUT/gpu_check.log (every step's whole output, also printed as it comes); models, native builds and
# compiled programs go to $PAGED_JAX_HOME (default under /tmp), never under $OUT. Exits 1 when a step
# failed or ran out of time, or when the GPU test step passed no test.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
REPORT="$OUT/gpu_report.md"
LOG="$OUT/gpu_check.log"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-540}"
# The project runs from this checkout without installing (the GPU machine has no package registry).
# TQDM_DISABLE: progress bars would fill the report's tails with carriage-return lines.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
export PAGED_JAX_HOME="${PAGED_JAX_HOME:-${TMPDIR:-/tmp}/paged-jax-gpu-check}"
export PAGED_JAX_COMPILE_CACHE="${PAGED_JAX_COMPILE_CACHE:-$PAGED_JAX_HOME/compile-cache}"
mkdir -p "$PAGED_JAX_HOME"
STEP_OUT="$PAGED_JAX_HOME/step.out"
# The files holding `gpu`-marked tests (named, not tests/: modules that import the server's packages,
# which the GPU machine lacks, would stop the collection).
GPU_TESTS="tests/test_gpu.py"
: > "$LOG"
FAILED=0

{ echo "# paged-jax GPU check"; echo; echo "$(date -u)  $(git rev-parse --short HEAD 2>/dev/null)"; echo; } > "$REPORT"

# step NAME SECONDS COMMAND...: run with at most SECONDS (and what is left of the budget), print and
# log its output as it comes, put its exit status, time and output's tail in the report.
step() {
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    printf '## %s: not run, out of time (budget %s s)\n\n' "$name" "$BUDGET" >> "$REPORT"
    FAILED=1; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc
  echo "== $name (limit $limit s): $*" | tee -a "$LOG"
  : > "$STEP_OUT"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG" "$STEP_OUT"  # printed, and kept, as it comes
  rc=${PIPESTATUS[0]}
  local verdict="exit $rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="exit $rc: out of time after $limit s"
  { printf '## %s (%s, %s s)\n\n`%s`\n\n```\n' "$name" "$verdict" "$((SECONDS - t0))" "$*"
    tail -n 40 "$STEP_OUT"; printf '```\n\n'; } >> "$REPORT"
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}

skipped() {  # skipped NAME: a GPU step's line in the report where there is no GPU
  printf '## %s: skipped: no GPU\n\n' "$1" >> "$REPORT"
}

step versions 60 "$PY" -c "
import platform, sys, jax, jaxlib
print(sys.version.split()[0], platform.machine(), 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)
print('devices', jax.devices(), 'default backend', jax.default_backend())
for d in jax.devices():
    print(d.device_kind, getattr(d, 'compute_capability', ''))
"
GPU=$("$PY" -c "import jax; print(int(jax.default_backend() == 'gpu'))" 2>/dev/null || echo 0)
# pyproject's addopts ask for pytest-xdist's workers: without xdist installed, they are set aside.
XDIST="-o addopts="
"$PY" -c "import xdist" 2> /dev/null && XDIST="-n 4 --dist load"
if [ "$GPU" = 1 ]; then
  command -v nvidia-smi > /dev/null && step nvidia-smi 20 nvidia-smi
  # -rs: the reason of every skip (fp8 where the GPU lacks it) in the report.
  # The step is host-bound compilation: 247-251 s in one process on a cold H200 (2026-11-27, twice), so
  # where pytest-xdist is installed (the GPU image has it) 4 workers compile side by side, sharing the
  # GPU's memory as they need it instead of each taking JAX's default 75 %; --dist load spreads the one
  # file's tests over them (pyproject's addopts keep a file on one worker).
  if XLA_PYTHON_CLIENT_PREALLOCATE=false step gpu-tests 280 "$PY" -m pytest -q -rs -p no:cacheprovider $XDIST -m gpu $GPU_TESTS \
     && ! grep -Eq '[1-9][0-9]* passed' "$STEP_OUT"; then
    echo "gpu-tests passed no test: FAILED" | tee -a "$LOG" >> "$REPORT"; FAILED=1
  fi
  step bench-kernel 90 "$PY" experiments/bench_kernel.py --batch 8 32 --context 256 1024
  step engine 150 "$PY" experiments/gpu_engine_check.py --backends auto reference --dtypes float32 bfloat16 \
       --num-prompts 32 --max-tokens 32
  step throughput 150 "$PY" experiments/bench_throughput.py --dataset sharegpt-like --num-prompts 128 --max-total-len 256 \
       --max-num-seqs 32 --attention-backend pallas --dtype bfloat16
  step hf-throughput 90 "$PY" experiments/bench_throughput.py --backend hf --hf-max-batch-size 32 --dataset sharegpt-like \
       --num-prompts 128 --max-total-len 256 --dtype bfloat16
  # The throughput step's workload, so the same KV pool and step shapes: its warm-up loads that step's
  # compiled programs from $PAGED_JAX_COMPILE_CACHE (until 2026-11-27 it sized the pool by its own
  # longest request, compiled all 75 programs again and ran out of the check's time on the H200).
  step profile-step 120 "$PY" experiments/profile_gpu_step.py --num-prompts 128 --max-num-seqs 32 --max-total-len 256 \
       --dtype bfloat16 --attention-backend pallas
else
  skipped nvidia-smi
  skipped gpu-tests
  step gpu-tests-collect 120 "$PY" -m pytest -q -p no:cacheprovider $XDIST -m gpu --collect-only $GPU_TESTS
  skipped bench-kernel
  step bench-kernel-cpu 90 "$PY" experiments/bench_kernel.py --batch 4 --context 64 --num-heads 4 \
       --head-dim 64 --iters 2 --repeats 1
  skipped engine
  step engine-cpu 180 "$PY" experiments/gpu_engine_check.py --backends auto --dtypes float32 \
       --num-prompts 4 --max-tokens 8
  skipped throughput
  step throughput-cpu 120 "$PY" experiments/bench_throughput.py --model paged_jax/models/data/default-model \
       --dataset sharegpt-like --num-prompts 4 --max-num-seqs 4 --max-total-len 64 --dtype bfloat16
  skipped hf-throughput
  step hf-throughput-cpu 60 "$PY" experiments/bench_throughput.py --model paged_jax/models/data/default-model --backend hf \
       --hf-max-batch-size 4 --dataset sharegpt-like --num-prompts 4 --max-total-len 64 --dtype bfloat16
  skipped profile-step
  step profile-step-cpu 150 "$PY" experiments/profile_gpu_step.py --model paged_jax/models/data/default-model \
       --num-prompts 4 --max-num-seqs 4 --max-total-len 64 --dtype bfloat16 --top 8
fi

[ "$FAILED" = 0 ] && RESULT="all steps passed" || RESULT="FAILED: see the steps above"
printf '**%s** (%s s in all)\n' "$RESULT" "$SECONDS" >> "$REPORT"
echo "report: $REPORT: $RESULT"
exit "$FAILED"
