#!/usr/bin/env bash
# Packs what a bare CUDA image lacks for scripts/gpu_check.sh into one archive: a machine that has
# CUDA torch and transformers but none of agl's other dependencies, and cannot reach a package
# index (this workplace's GPU machines). Run here, where pip can download; carry the archive there.
#
#   bash scripts/gpu_site.sh                      # writes .whl/gpu-site.tar.xz (.whl/ is ignored)
#   GPU_SITE_PYTHON_VERSION=3.11 bash scripts/gpu_site.sh   # for another CPython there (default 3.12)
#
# There (the repository root), before gpu_check.sh:
#   tar -xJf .whl/gpu-site.tar.xz -C /tmp
#   export PYTHONPATH=/tmp/gpu-site:$PWD/sdk:$PWD/sidecar:$PWD/trainer:$PWD/integrations:$PWD/testing:$PWD
#   PYTHON=python3 GPU_CHECK_TEST_PATHS="tests/algorithms/test_torch_backend.py tests/verl/test_gpu.py" \
#       bash scripts/gpu_check.sh
#
# The versions are the ones this checkout's .venv holds (pip freeze), so the GPU runs what the CPU
# tests ran. Left out: torch, transformers and what the image already has, vLLM (its CUDA wheel is
# far over what a carry may hold), Ray's Java jars, dashboard source maps and RLlib, and debug
# symbols of the compiled modules (strip). pytest-asyncio is left out too: the gpu tests are not
# async, and a plugin built for another pytest would stop the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."

PY_VERSION="${GPU_SITE_PYTHON_VERSION:-3.12}"
VENV_PY=.venv/bin/python
OUT_DIR=.whl
SITE_NAME=gpu-site
# Ray and verl (the verl backend), tensordict, hydra/omegaconf, what verl imports on its paths
# (fastapi/pydantic, datasets), and agl's own (msgspec, orjson, OpenTelemetry).
PACKAGES=(
    ray verl tensordict omegaconf hydra-core codetiming pydantic pydantic_core annotated-types
    typing-inspection fastapi starlette jsonschema jsonschema-specifications referencing rpds-py orjson
    msgspec dill multiprocess pyvers cachetools colorful python-multipart uvicorn zstandard wcwidth
    jsonpointer datasets googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-proto
    opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport
    opentelemetry-exporter-otlp-common
    # the whole RL run (bench/gpu_rl_run.py: agl train with the sidecar, the embedded engine, the hops
    # harness over the openai SDK): aiohttp and the sidecar's loop and parser, openai, rich, and what
    # every run writes (tensorboard/ through torch.utils.tensorboard, reward.png through matplotlib)
    aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna httptools uvloop
    openai httpx2 httpcore2 h11 anyio sniffio jiter distro rich markdown-it-py mdurl pygments
    tensorboard absl-py markdown werkzeug matplotlib contourpy cycler fonttools kiwisolver pillow
    pyparsing python-dateutil six
)

if [[ ! -x "$VENV_PY" ]]; then
    echo "gpu_site: no $VENV_PY (run \`make venv\` first: the versions are read from it)" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$VENV_PY" -m pip freeze >"$work/freeze.txt"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for name in "${PACKAGES[@]}"; do
    pin="$(grep -i "^${name//_/[-_]}==" "$work/freeze.txt" || true)"
    if [[ -z "$pin" ]]; then
        echo "gpu_site: $name is not in .venv; install the dev extras (make venv)" >&2
        exit 1
    fi
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
        --implementation cp "${platforms[@]}" -d "$work/wheels" "$pin"
done
site="$work/$SITE_NAME"
"$VENV_PY" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${platforms[@]}" --target "$site" "$work"/wheels/*.whl
# antlr4-python3-runtime 4.9.3 (omegaconf's pin) exists only as a source archive: pure Python, copied.
venv_site="$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp -r "$venv_site"/antlr4 "$venv_site"/antlr4_python3_runtime-*.dist-info "$site"/
rm -rf "$site"/ray/jars "$site"/ray/rllib "$site"/ray/dashboard/client/build/static/js/*.map
# TensorBoard's web page (a run only writes event files) and matplotlib's sample data
rm -rf "$site"/tensorboard/webfiles.zip "$site"/matplotlib/mpl-data/sample_data
find "$site" -name __pycache__ -prune -exec rm -rf {} +
find "$site" \( -name "*.so" -o -path "*/ray/core/src/ray/*" \) -type f -size +1M \
    -exec strip --strip-unneeded {} + 2>/dev/null || true
mkdir -p "$OUT_DIR"
XZ_OPT="-9 -T0" tar -cJf "$OUT_DIR/$SITE_NAME.tar.xz" -C "$work" "$SITE_NAME"
echo "gpu_site: $OUT_DIR/$SITE_NAME.tar.xz ($(du -h "$OUT_DIR/$SITE_NAME.tar.xz" | cut -f1), CPython $PY_VERSION)"
