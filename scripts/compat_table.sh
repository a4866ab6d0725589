#!/usr/bin/env bash
# docs/protocols.md's compatibility table ("Will my harness work?"): `agl harness check` runs each
# harness once through a tool loop the scripted engine drives (a shell command, then an answer), then
# `agl harness table` prints one Markdown row per harness: its version, the features its requests
# exercised, and the result.
#
#   bash scripts/compat_table.sh             # from the repository root or anywhere; needs `make clis`
#   bash scripts/compat_table.sh OUT_DIR     # also keep each report as OUT_DIR/<harness>.json
#
# The harnesses: the OpenAI Python SDK (tests/harness_check/harnesses/tool_loop.py), and Claude Code
# and Codex at the versions testing/clis/package.json pins. Exit status: 0 when the table was printed
# (a harness that fails its check is a row that says why); 2 when a CLI is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True
OUT="${1:-}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
[[ -n "$OUT" ]] || OUT="$WORK/reports"
mkdir -p "$OUT"

agl() { "$PY" -c 'import sys; from agl_trainer.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }

cli() {  # the CLI's path at its pinned version, or why not (exit 2)
    "$PY" -c "
import sys
from agl_testing.clis import installed_cli
found = installed_cli(sys.argv[1])
print(found if isinstance(found, str) else f'{found.path} {found.version}')
sys.exit(1 if isinstance(found, str) else 0)" "$1"
}
read -r CLAUDE CLAUDE_VERSION < <(cli claude) || { echo "compat_table: $(cli claude)" >&2; exit 2; }
read -r CODEX CODEX_VERSION < <(cli codex) || { echo "compat_table: $(cli codex)" >&2; exit 2; }
OPENAI_VERSION="$("$PY" -c 'import openai; print(openai.__version__)')"

answer='"The command printed hello."'
echo "{\"turns\": [{\"tool_calls\": [{\"name\": \"ls\", \"arguments\": {}}]}, $answer]}" >"$WORK/openai.json"
echo "{\"turns\": [{\"tool_calls\": [{\"name\": \"Bash\", \"arguments\": {\"command\": \"echo hello\", \"description\": \"Print hello\"}}]}, $answer]}" >"$WORK/claude.json"
echo "{\"turns\": [{\"tool_calls\": [{\"name\": \"exec_command\", \"arguments\": {\"cmd\": \"echo hello\"}}]}, $answer]}" >"$WORK/codex.json"
mkdir -p "$WORK/claude-home" "$WORK/codex-home/.codex"
cat >"$WORK/codex-home/.codex/config.toml" <<'EOF'
model = "tiny"
model_provider = "agl"

[model_providers.agl]
name = "agl"
base_url = "http://127.0.0.1:9/v1"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
EOF

check() {  # NAME VERSION REPORT -- COMMAND...: a failing check is a row, not the script's end
    local name="$1" version="$2" report="$3"
    shift 3
    agl harness check --json --timeout-s 300 --name "$name" --harness-version "$version" "$@" \
        >"$OUT/$report.json" || true
    echo "compat_table: $name: $("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["verdict"])' "$OUT/$report.json" 2>&1 | tail -1)" >&2
}

check "OpenAI Python SDK" "$OPENAI_VERSION" openai-sdk --script "$WORK/openai.json" \
    -- "$PY" tests/harness_check/harnesses/tool_loop.py
check "Claude Code" "$CLAUDE_VERSION" claude-code --script "$WORK/claude.json" --env "HOME=$WORK/claude-home" \
    --env DISABLE_TELEMETRY=1 --env CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 --env DISABLE_AUTOUPDATER=1 \
    -- "$CLAUDE" -p "Run echo hello, then tell me what it printed." --model tiny --allowedTools Bash
check "Codex CLI" "$CODEX_VERSION" codex --script "$WORK/codex.json" --env "HOME=$WORK/codex-home" \
    --env "CODEX=$CODEX" --cwd "$WORK" \
    -- sh -c 'exec "$CODEX" exec --skip-git-repo-check -c "model_providers.agl.base_url=\"$OPENAI_BASE_URL\"" "Run echo hello, then say what it printed."'

agl harness table "$OUT/openai-sdk.json" "$OUT/claude-code.json" "$OUT/codex.json"
