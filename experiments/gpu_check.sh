#!/usr/bin/env bash
# Everything a session with a CUDA GPU should measure, in one run; writes $OUT/gpu_report.md
# (and each step's full log beside it). Run on the device machine from the repository root:
#   bash experiments/gpu_check.sh          # OUT defaults to ./gpu_check_out
# Try it on the CPU first (GPU-only steps then skip or run their CPU paths), so the GPU minutes go
# to the GPU. Each step has its own time limit, and a failing step does not stop the others.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
REPORT="$OUT/gpu_report.md"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PAGED_JAX_HOME="$OUT/home"

step() {  # step NAME SECONDS COMMAND...: run, keep the log, put its tail and status in the report
  local name="$1" limit="$2"; shift 2
  local log="$OUT/$name.log" t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  { echo "## $name (exit $rc, $((SECONDS - t0)) s)"; echo; echo '`'"$*"'`'; echo; echo '```';
    tail -n 40 "$log"; echo '```'; echo; } >> "$REPORT"
}

{ echo "# paged-jax GPU check"; echo; date -u; echo; } > "$REPORT"
step versions 120 "$PY" -c "import sys, jax, jaxlib; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices()); print(jax.default_backend())"
step nvidia-smi 30 nvidia-smi
# The GPU-marked tests (the Pallas kernels compiled for CUDA against the references), then the
# kernel and step tests that run anywhere.
step gpu-tests 480 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_pallas_kernels.py tests/test_pallas_variants.py
step kernel-tests 480 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas_kernels.py tests/test_pallas_variants.py tests/test_decode_attention.py tests/test_step_lowering.py
# Paged against contiguous decode attention (paper Fig. 18a).
step bench-kernel 480 "$PY" experiments/bench_kernel.py
# The engine end to end: greedy tokens of each backend and dtype against the reference in float32.
step engine 480 "$PY" experiments/gpu_engine_check.py --backends reference pallas --dtypes float32 bfloat16
# Throughput on the ShareGPT-like workload (GPT-2-124M-shaped random model).
step throughput 480 "$PY" experiments/bench_throughput.py --dataset sharegpt-like --num-prompts 256
echo "report: $REPORT"
