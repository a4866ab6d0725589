#!/usr/bin/env bash
# What a machine with a GPU runs, as one call (offline: no hub access). First run on an H200 on
# 2026-12-04 (docs/results.md, "On a GPU"); scripts/gpu_site.sh packs what a bare CUDA image lacks.
#
#   part                                                       estimate   limit   env for the limit
#   1. gpu tests (pytest -m gpu): bf16 steps, packed          ~130 s     150 s   GPU_CHECK_TESTS_LIMIT_S
#      micro-batches on CUDA, chunked log-probs, varlen
#      attention, the embedded engine on CUDA
#   2. bf16 step, Qwen2-0.5B shape, torch + verl (sdpa):       ~80 s     120 s   GPU_CHECK_STEP_LIMIT_S
#      step time, tokens/s, MFU (model FLOPs; 6ND too),
#      micro-batches of each, weights export (3 timed)
#   3. the same with attn_implementation agl_varlen            ~75 s     110 s   GPU_CHECK_VARLEN_LIMIT_S
#      (packed rows at each sample's cost)
#   4. log-probs over the 151,936 vocabulary, whole vs         ~15 s      40 s   GPU_CHECK_CHUNK_LIMIT_S
#      chunked: time and peak memory (K = 8192, bf16)
#   5. a whole RL run: examples/hops on the GPU (embedded     ~110 s     140 s   GPU_CHECK_RL_LIMIT_S
#      engine on CUDA, torch backend in bf16), 60 s of
#      training (GPU_CHECK_RL_BUDGET_S): steps, step time
#      and its split, the learning curve
#   (6. GPU_CHECK_FLEX=1: the torch step with flex_attention,  ~50 s      60 s   GPU_CHECK_FLEX_LIMIT_S)
#   total                                                     ~410 s     560 s   (under a device's 600 s a command)
#
#   bash scripts/gpu_check.sh                 # from the repository root or anywhere
#   AGL_GPU_CHECK_DRY=1 bash scripts/gpu_check.sh    # (or --cpu-smoke) every part at tiny size on the CPU:
#                                                    # no GPU needed; checks the script end to end (4-8 min on 2 shared cores)
#   PYTHON=/path/to/python AGL_VLLM_PYTHON=/path/to/vllm-python bash scripts/gpu_check.sh
#   GPU_CHECK_PEAK_TFLOPS=312 bash scripts/gpu_check.sh      # another GPU's bf16 dense peak (A100: 312)
#   GPU_CHECK_TEST_PATHS="tests/verl/test_gpu.py" bash scripts/gpu_check.sh   # collect only these files
#     (the default names the files whose dependencies a bare CUDA image with scripts/gpu_site.sh has;
#     `tests` collects everything, which needs the dev extras)
#   GPU_CHECK_PARTS="step rl" bash scripts/gpu_check.sh       # some parts only: tests step varlen chunk rl flex
#
# Numbers also land as JSON in GPU_CHECK_OUT (default: $OUT when the device tool sets it, else
# runs/gpu-check): step.json, step-varlen.json, chunked.json, rl.json, gpu-tests.xml, and the RL run.
# Exit status: 0 when every part passed; 1 when a part failed (each part still runs); 2 when there is
# no CUDA GPU here (and no dry mode).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY="${AGL_GPU_CHECK_DRY:-}"
for argument in "$@"; do
    case "$argument" in
        --cpu-smoke) DRY=1 ;;
        *) echo "gpu_check: unknown argument $argument (the only one is --cpu-smoke)" >&2; exit 2 ;;
    esac
done
PY="${PYTHON:-.venv/bin/python}"
PEAK="${GPU_CHECK_PEAK_TFLOPS:-989}"
TESTS_LIMIT_S="${GPU_CHECK_TESTS_LIMIT_S:-150}"
STEP_LIMIT_S="${GPU_CHECK_STEP_LIMIT_S:-120}"
VARLEN_LIMIT_S="${GPU_CHECK_VARLEN_LIMIT_S:-110}"
CHUNK_LIMIT_S="${GPU_CHECK_CHUNK_LIMIT_S:-40}"
RL_LIMIT_S="${GPU_CHECK_RL_LIMIT_S:-140}"
RL_BUDGET_S="${GPU_CHECK_RL_BUDGET_S:-60}"
FLEX_LIMIT_S="${GPU_CHECK_FLEX_LIMIT_S:-60}"
PARTS="${GPU_CHECK_PARTS:-tests step varlen chunk rl}"
if [[ -n "${GPU_CHECK_FLEX:-}" ]]; then PARTS="$PARTS flex"; fi
DEFAULT_TESTS="tests/algorithms/test_torch_backend.py tests/algorithms/test_varlen_attention.py tests/verl/test_gpu.py tests/gpu_check/test_gpu_parts.py"
read -r -a TEST_PATHS <<<"${GPU_CHECK_TEST_PATHS:-$DEFAULT_TESTS}"
OUT_DIR="${GPU_CHECK_OUT:-${OUT:-runs/gpu-check}}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True TOKENIZERS_PARALLELISM=false

if [[ ! -x "$PY" ]] && ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no Python at $PY (run \`make venv\` or set PYTHON)" >&2
    exit 2
fi
if [[ -n "$DRY" ]]; then
    echo "gpu_check: dry mode (AGL_GPU_CHECK_DRY / --cpu-smoke): every part at tiny size on the CPU" \
        "(limits x3: a shared CPU is slower than a GPU, and the dry mode checks the script, not the times)"
    DEVICE=cpu
    for limit in TESTS_LIMIT_S STEP_LIMIT_S VARLEN_LIMIT_S CHUNK_LIMIT_S RL_LIMIT_S FLEX_LIMIT_S; do
        printf -v "$limit" '%d' $((${!limit} * 3))
    done
else
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; then
        echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or failed); this script is for GPU machines" \
            "(AGL_GPU_CHECK_DRY=1 runs its parts on the CPU)" >&2
        exit 2
    fi
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: $PY's torch does not see CUDA (a CPU-only torch?); install the CUDA build" >&2
        exit 2
    fi
    DEVICE=cuda
    if [[ -z "${AGL_VLLM_PYTHON:-}" ]]; then
        if "$PY" -c "import vllm" >/dev/null 2>&1; then
            export AGL_VLLM_PYTHON="$PY"
        else
            echo "gpu_check: note: $PY has no vllm and AGL_VLLM_PYTHON is unset: the vLLM gpu tests will say so" >&2
        fi
    fi
fi
mkdir -p "$OUT_DIR"

# agl and agl-sidecar (the RL run starts both) beside the interpreter, on PATH, or as shims that run
# this interpreter (a bare image with agl on PYTHONPATH has no console scripts)
python_path="$(command -v "$PY")"
python_dir="$(dirname "$python_path")"
shims=""
for tool in agl agl-sidecar; do
    if [[ ! -x "$python_dir/$tool" ]] && ! command -v "$tool" >/dev/null 2>&1; then
        shims="${shims:-$(mktemp -d)}"
        module="agl_trainer.cli"
        if [[ "$tool" == agl-sidecar ]]; then module="agl_sidecar.cli"; fi
        printf '#!/bin/sh\nexec "%s" -c "import sys; from %s import main; sys.exit(main())" "$@"\n' \
            "$python_path" "$module" >"$shims/$tool"
        chmod +x "$shims/$tool"
    fi
done
if [[ -n "$shims" ]]; then export PATH="$shims:$PATH"; fi

failed=()
summary=()
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
run_part() {  # run_part NAME ESTIMATE_S LIMIT_S COMMAND...
    local name="$1" estimate="$2" limit="$3"
    shift 3
    echo
    echo "=== gpu_check: $name (estimate ${estimate} s, limit ${limit} s)"
    local started=$SECONDS
    timeout --kill-after=15 "$limit" "$@"
    local status=$?
    local took=$((SECONDS - started))
    echo "=== gpu_check: $name: exit $status after $took s"
    summary+=("$(printf '%-44s exit %3d  %4d s (estimate %d, limit %d)' "$name" "$status" "$took" "$estimate" "$limit")")
    if [[ $status -ne 0 ]]; then
        failed+=("$name (exit $status)")
    fi
}
not_run() {  # not_run NAME WHY
    echo
    echo "=== gpu_check: $1: not run: $2"
    summary+=("$(printf '%-44s not run: %s' "$1" "$2")")
    failed+=("$1 (not run)")
}

if [[ -n "$DRY" ]]; then
    SIZE=(--device cpu --model tiny --steps 1 --tasks 2 --per-task 2 --max-len 128 --exports 2)
    CHUNK=(--positions 256 --vocab 8192 --hidden 128 --chunk 32 --rounds 1)
    RL=(--device cpu --budget-s 10 --max-steps 2)
else
    SIZE=(--device cuda --model 0.5b --model-dir "$OUT_DIR/model-0.5b" --steps 3 --exports 3)
    CHUNK=(--device cuda --dtype bfloat16 --positions 8192 --rounds 3)
    RL=(--device cuda --budget-s "$RL_BUDGET_S")
fi

if wanted tests; then
    if [[ -n "$DRY" ]]; then  # the selection imports and finds the gpu tests; running them needs CUDA
        run_part "gpu tests (collected only: dry)" 130 "$TESTS_LIMIT_S" \
            "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "${TEST_PATHS[@]}"
    else
        # -p no:cacheprovider: the checkout may be read-only on a fresh machine.
        run_part "gpu tests" 130 "$TESTS_LIMIT_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider \
            --junitxml "$OUT_DIR/gpu-tests.xml" "${TEST_PATHS[@]}"
    fi
fi
if wanted step; then
    run_part "bf16 step, torch + verl, sdpa" 80 "$STEP_LIMIT_S" "$PY" bench/gpu_step.py "${SIZE[@]}" \
        --backend both --peak-tflops "$PEAK" --json "$OUT_DIR/step.json"
fi
if wanted varlen; then
    run_part "bf16 step, torch + verl, agl_varlen" 75 "$VARLEN_LIMIT_S" "$PY" bench/gpu_step.py "${SIZE[@]}" \
        --backend both --attn agl_varlen --peak-tflops "$PEAK" --json "$OUT_DIR/step-varlen.json"
fi
if wanted chunk; then
    run_part "log-probs whole vs chunked" 15 "$CHUNK_LIMIT_S" "$PY" bench/chunked_logprobs.py "${CHUNK[@]}" \
        --json "$OUT_DIR/chunked.json"
fi
if wanted rl; then
    needs="aiohttp, httptools, uvloop, msgspec, openai, rich, yaml, matplotlib, tensorboard, opentelemetry.sdk"
    if missing="$("$PY" -c "
import importlib.util, sys
names = [n.strip() for n in '$needs'.split(',')]
gone = [n for n in names if importlib.util.find_spec(n) is None]
print(', '.join(gone)); sys.exit(1 if gone else 0)" 2>&1)"; then
        run_part "whole RL run (hops, engine + trainer on $DEVICE)" 110 "$RL_LIMIT_S" "$PY" bench/gpu_rl_run.py \
            "${RL[@]}" --out "$OUT_DIR/rl" --json "$OUT_DIR/rl.json"
    else
        not_run "whole RL run" "$PY cannot import $missing (pack them with scripts/gpu_site.sh)"
    fi
fi
if wanted flex; then
    if [[ -n "$DRY" ]]; then
        not_run "bf16 step, torch, flex_attention" "flex_attention has no backward on the CPU"
    else
        run_part "bf16 step, torch, flex_attention" 50 "$FLEX_LIMIT_S" "$PY" bench/gpu_step.py "${SIZE[@]}" \
            --backend torch --attn flex_attention --peak-tflops "$PEAK" --json "$OUT_DIR/step-flex.json"
    fi
fi

echo
echo "gpu_check: parts ($DEVICE), $SECONDS s in all:"
printf '  %s\n' "${summary[@]}"
if [[ ${#failed[@]} -eq 0 ]]; then
    echo "gpu_check: all parts passed"
    exit 0
fi
echo "gpu_check: failed: ${failed[*]}"
exit 1
