#!/usr/bin/env bash
# Installs the peer proxies the sidecar benchmarks compare against, each in a throwaway venv under
# /tmp (never in the repo): the litellm proxy and, when it installs in reasonable time, Agent
# Lightning 1.0.x (its `agl-server` gateway; needs Python 3.12). Idempotent: a stamp file per venv
# records a finished install; a failed optional peer leaves a `.failed` file saying why.
# Usage: bash scripts/setup_bench_peers.sh
#   env: PEER_LITELLM_VENV=/tmp/agl-peer-litellm  PEER_AGL_VENV=/tmp/agl-peer-agentlightning
#        PEER_AGL_TIMEOUT=420 (seconds allowed for the Agent Lightning install)  PEER_SKIP_AGL=1
# Exit status: 0 when the litellm proxy is ready (Agent Lightning is optional), 1 otherwise.
set -uo pipefail

LITELLM_VENV="${PEER_LITELLM_VENV:-/tmp/agl-peer-litellm}"
AGL_VENV="${PEER_AGL_VENV:-/tmp/agl-peer-agentlightning}"
AGL_TIMEOUT="${PEER_AGL_TIMEOUT:-420}"
# What `pip install 'litellm[proxy]'` resolved to on these machines (ENVIRONMENT.md); pinned so a
# rerun measures the same proxy.
LITELLM_PIN="litellm[proxy]==1.108.7"
AGL_PIN="agentlightning>=1.0,<1.1"
export PIP_DISABLE_PIP_VERSION_CHECK=1 LITELLM_LOCAL_MODEL_COST_MAP=True

start=$(date +%s)
step() { echo "setup_bench_peers: [$(( $(date +%s) - start ))s] $*"; }
# pip, without this machine's one-line-per-package notes about empty local mirrors.
pip_quiet() {
    "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
    return "${PIPESTATUS[0]}"
}

# Guard: these venvs are throwaway and must live outside the repository.
for v in "$LITELLM_VENV" "$AGL_VENV"; do
    case "$v" in /tmp/*) ;; *) echo "setup_bench_peers: $v is not under /tmp; refusing" >&2; exit 2 ;; esac
done

python312() {
    # pyenv's python3.12 shim only resolves when 3.12 is an active version: ask pyenv for the path.
    local p
    for p in "$(command -v python3.12 2>/dev/null)" "$(pyenv prefix 3.12 2>/dev/null)/bin/python3.12" \
             /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        if [[ -n "$p" && -x "$p" ]] && "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$p"; return 0
        fi
    done
    return 1
}

setup_litellm() {
    local stamp="$LITELLM_VENV/.installed-stamp"
    if [[ -f "$stamp" && "$(head -1 "$stamp")" == "$LITELLM_PIN" ]]; then
        step "litellm proxy ready in $LITELLM_VENV ($(tail -1 "$stamp"))"; return 0
    fi
    local t0=$(date +%s)
    rm -rf "$LITELLM_VENV"
    step "creating $LITELLM_VENV (python3.11) and installing $LITELLM_PIN"
    python3.11 -m venv "$LITELLM_VENV" || { step "FAILED: python3.11 -m venv"; return 1; }
    if ! pip_quiet "$LITELLM_VENV/bin/pip" install -q "$LITELLM_PIN"; then
        step "FAILED: pip install $LITELLM_PIN (see pip's message above)"; return 1
    fi
    local version
    version=$("$LITELLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))') || {
        step "FAILED: litellm does not import in $LITELLM_VENV"; return 1; }
    test -x "$LITELLM_VENV/bin/litellm" || { step "FAILED: no litellm console script"; return 1; }
    printf '%s\nlitellm %s\n' "$LITELLM_PIN" "$version" > "$stamp"
    step "litellm proxy $version installed in $(( $(date +%s) - t0 ))s"
}

setup_agentlightning() {
    local stamp="$AGL_VENV/.installed-stamp" failed="$AGL_VENV.failed"
    if [[ -f "$stamp" && "$(head -1 "$stamp")" == "$AGL_PIN" ]]; then
        step "Agent Lightning ready in $AGL_VENV ($(tail -1 "$stamp"))"; return 0
    fi
    if [[ -f "$failed" ]]; then  # a failed install is not retried on every bench run
        step "Agent Lightning skipped: an earlier install failed ($(cat "$failed")); rm $failed to retry"
        return 1
    fi
    local t0=$(date +%s) py
    fail() { echo "$*" > "$failed"; step "Agent Lightning FAILED: $*"; }
    py=$(python312) || { fail "no Python 3.12 interpreter found"; return 1; }
    rm -rf "$AGL_VENV"
    step "creating $AGL_VENV ($py) and installing '$AGL_PIN' (limit ${AGL_TIMEOUT}s)"
    "$py" -m venv "$AGL_VENV" || { fail "$py -m venv failed"; return 1; }
    pip_quiet timeout "$AGL_TIMEOUT" "$AGL_VENV/bin/pip" install -q "$AGL_PIN"
    local rc=$?
    if (( rc == 124 )); then fail "pip install did not finish within ${AGL_TIMEOUT}s"; return 1; fi
    if (( rc != 0 )); then fail "pip install '$AGL_PIN' exited $rc (see pip's message above)"; return 1; fi
    local version
    version=$("$AGL_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("agentlightning"))') || {
        fail "agentlightning does not import"; return 1; }
    test -x "$AGL_VENV/bin/agl-server" || { fail "agentlightning $version has no agl-server script"; return 1; }
    printf '%s\nagentlightning %s\n' "$AGL_PIN" "$version" > "$stamp"
    step "Agent Lightning $version installed in $(( $(date +%s) - t0 ))s"
}

setup_litellm; litellm_rc=$?
if [[ "${PEER_SKIP_AGL:-0}" == 1 ]]; then
    step "Agent Lightning skipped (PEER_SKIP_AGL=1)"
else
    setup_agentlightning || true
fi
step "done"
exit $litellm_rc
