"""`agl harness check` on the real coding CLIs from npm, at the versions testing/clis pins (`make clis`):
Claude Code (`claude -p`, Anthropic Messages) and Codex (`codex exec`, the Responses API), each through
a tool loop the scripted engine drives (a shell command, then an answer). The check must pass: every
request answered below 400, every call recorded with the engine's token IDs, and the call that
carries the command's output merged onto the call that asked for it (one sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_testing.clis import Cli, installed_cli
from agl_trainer.cli import main
from tests.support.required import requires

pytestmark = pytest.mark.slow
ANSWER = "The command printed hello."
QUIET = ["--env", "DISABLE_TELEMETRY=1", "--env", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
         "--env", "DISABLE_AUTOUPDATER=1"]  # fmt: skip


def cli(name: str) -> Cli:
    found = installed_cli(name)
    return found if isinstance(found, Cli) else None  # type: ignore[return-value]


def why(name: str) -> str:
    found = installed_cli(name)
    return found if isinstance(found, str) else ""


def script(tmp_path: Path, tool: str, arguments: dict) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": [{"tool_calls": [{"name": tool, "arguments": arguments}]}, ANSWER]}))
    return path


def run_check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["harness", "check", "--json", "--timeout-s", "240", *argv])
    return code, json.loads(capsys.readouterr().out)


def assert_the_tool_loop_merges(code: int, report: dict, api: str) -> None:
    assert code == 0 and report["ok"], report["verdict"]
    model_calls = [call for call in report["calls"] if call["recorded"] is not None]
    assert {call["api"] for call in model_calls} == {api}
    assert all(call["recorded"]["token_ids"] and call["recorded"]["logprobs"] for call in model_calls)
    [asked] = [call for call in model_calls if call["answer"].startswith("<tool_call>")]
    [answered] = [call for call in model_calls if call["answer"] == ANSWER]
    assert answered["placement"] == f"merged onto #{asked['number']}", answered["placement"]
    assert answered["sample"] == asked["sample"] and "tool results" in report["features"]
    assert ANSWER in report["harness"]["log_tail"]  # the CLI printed the scripted answer: its loop went through


@requires(cli("claude") is not None, why("claude"))
def test_claude_code_runs_a_bash_tool_loop_through_agl(tmp_path, capsys):
    claude = cli("claude")
    home = tmp_path / "home"
    home.mkdir()
    code, report = run_check(
        capsys, "--script", str(script(tmp_path, "Bash", {"command": "echo hello", "description": "Print hello"})),
        "--env", f"HOME={home}", *QUIET, "--name", "Claude Code", "--harness-version", claude.version,
        "--", str(claude.path), "-p", "Run echo hello, then tell me what it printed.", "--model", "tiny",
        "--allowedTools", "Bash",
    )  # fmt: skip
    assert_the_tool_loop_merges(code, report, "anthropic.messages")
    assert "streaming" in report["features"]


@requires(cli("codex") is not None, why("codex"))
def test_codex_runs_a_shell_tool_loop_through_agl(tmp_path, capsys):
    codex = cli("codex")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    # Codex reads its provider from ~/.codex/config.toml; the URL comes from the runner's OPENAI_BASE_URL
    (home / ".codex" / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "agl"\n\n[model_providers.agl]\nname = "agl"\n'
        'base_url = "http://127.0.0.1:9/v1"\nwire_api = "responses"\nenv_key = "OPENAI_API_KEY"\n'
    )
    command = 'exec "$CODEX" exec --skip-git-repo-check -c "model_providers.agl.base_url=\\"$OPENAI_BASE_URL\\"" "$PROMPT"'
    code, report = run_check(
        capsys, "--script", str(script(tmp_path, "exec_command", {"cmd": "echo hello"})),
        "--env", f"HOME={home}", "--env", f"CODEX={codex.path}", "--env", "PROMPT=Run echo hello, then say what it printed.",
        "--cwd", str(tmp_path), "--name", "Codex", "--harness-version", codex.version, "--", "sh", "-c", command,
    )  # fmt: skip
    assert_the_tool_loop_merges(code, report, "openai.responses")
