#!/usr/bin/env bash
# What a machine with a GPU runs first (offline: no hub access; its parts' time limits cap it at 10 minutes;
# first run on an H200 on 2026-12-04, docs/results.md; scripts/gpu_site.sh packs what a bare CUDA image lacks):
#   1. every `gpu` test (pytest -m gpu): bf16 steps, vLLM collocated sleep/wake/sync, GPU weight transfer
#   2. a bf16 training step on a ~0.5B model (Qwen2-0.5B architecture, random weights, built here)
#      with the torch backend and the verl backend: tokens/s and MFU (peak 989 TFLOP/s, H200 bf16 dense)
#
#   bash scripts/gpu_check.sh                 # from the repository root or anywhere
#   PYTHON=/path/to/python AGL_VLLM_PYTHON=/path/to/vllm-python bash scripts/gpu_check.sh
#   GPU_CHECK_PEAK_TFLOPS=312 bash scripts/gpu_check.sh      # another GPU's bf16 dense peak (A100: 312)
#   GPU_CHECK_TEST_PATHS="tests/verl/test_gpu.py" bash scripts/gpu_check.sh   # collect only these files
#     (`pytest -m gpu tests` imports every test module: on a machine without the dev extras, name the
#     files whose dependencies are there)
#
# Exit status: 0 when every part passed; 1 when a part failed (each part still runs); 2 when there is
# no CUDA GPU here. Every part has its own time limit, so the whole stays under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
PEAK="${GPU_CHECK_PEAK_TFLOPS:-989}"
TESTS_LIMIT_S="${GPU_CHECK_TESTS_LIMIT_S:-330}"
STEP_LIMIT_S="${GPU_CHECK_STEP_LIMIT_S:-240}"
read -r -a TEST_PATHS <<<"${GPU_CHECK_TEST_PATHS:-tests}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True TOKENIZERS_PARALLELISM=false

if [[ ! -x "$PY" ]] && ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no Python at $PY (run \`make venv\` or set PYTHON)" >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or failed); this script is for GPU machines" >&2
    exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PY's torch does not see CUDA (a CPU-only torch?); install the CUDA build" >&2
    exit 2
fi
if [[ -z "${AGL_VLLM_PYTHON:-}" ]]; then
    if "$PY" -c "import vllm" >/dev/null 2>&1; then
        export AGL_VLLM_PYTHON="$PY"
    else
        echo "gpu_check: note: $PY has no vllm and AGL_VLLM_PYTHON is unset: the vLLM gpu tests will say so" >&2
    fi
fi

failed=()
run_part() {  # run_part NAME LIMIT_S COMMAND...
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== gpu_check: $name (limit ${limit} s)"
    local started=$SECONDS
    timeout --kill-after=15 "$limit" "$@"
    local status=$?
    echo "=== gpu_check: $name: exit $status after $((SECONDS - started)) s"
    if [[ $status -ne 0 ]]; then
        failed+=("$name (exit $status)")
    fi
}

# -p no:cacheprovider: the checkout may be read-only on a fresh machine.
run_part "gpu tests" "$TESTS_LIMIT_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider "${TEST_PATHS[@]}"
run_part "bf16 step, ~0.5B, torch + verl" "$STEP_LIMIT_S" \
    "$PY" bench/gpu_step.py --device cuda --backend both --steps 3 --peak-tflops "$PEAK"

echo
if [[ ${#failed[@]} -eq 0 ]]; then
    echo "gpu_check: all parts passed"
    exit 0
fi
echo "gpu_check: failed: ${failed[*]}"
exit 1
