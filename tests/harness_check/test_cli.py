"""`agl harness check --help` explains the check, and a usage error is named before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.cli import main


def test_check_help_explains_the_environment_the_script_and_the_exit_status(capsys):
    with pytest.raises(SystemExit) as done:
        main(["harness", "check", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: agl harness check [options] -- COMMAND [ARG ...]")
    for needed in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "AGL_TASK", "--script FILE", "tool_calls:",
                   "Exit status: 0 when", "$OPENAI_BASE_URL", "agl harness table", "--keep DIR", "--json"):  # fmt: skip
        assert needed in out, needed


def test_agl_help_lists_harness_and_harness_help_lists_its_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "harness" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["harness", "--help"])
    out = capsys.readouterr().out
    assert "check" in out and "table" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no harness command (fix: agl harness check [options] -- COMMAND"),
        (["--", "agl-no-such-program-here"], "cannot run 'agl-no-such-program-here': no such program"),
        (["--", "./no/such/harness.py"], "cannot run './no/such/harness.py': no such program"),
        (["--env", "NOEQUALS", "--", "true"], "--env 'NOEQUALS': expected NAME=VALUE"),
        (["--timeout-s", "0", "--", "true"], "--timeout-s 0.0: expected seconds"),
        (["--timeout-s", "nan", "--", "true"], "--timeout-s nan: expected seconds"),
        (["--task", "[1]", "--", "true"], "--task: a task is a JSON object"),
        (["--task", "{", "--", "true"], "--task: not JSON"),
        (["--cwd", "/no/such/dir", "--", "true"], "--cwd /no/such/dir: no such directory"),
        (["--config", "/no/such/config.yaml"], "--config /no/such/config.yaml: config file"),
    ],
)
def test_a_usage_error_is_named_with_its_fix(capsys, argv, message):
    assert main(["harness", "check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agl: error: ") and message in err, err


def test_a_config_supplies_the_command_env_and_first_task(tmp_path: Path, capsys):
    """--config takes the harness from `agl train`'s config; the command still must exist."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t1", "question": "2+2"}\n')
    config = tmp_path / "config.yaml"
    config.write_text(f"tasks: {tasks}\nharness:\n  command: [agl-no-such-program-here, --flag]\n  env: {{A: b}}\n")
    assert main(["harness", "check", "--config", str(config)]) == 2
    assert "cannot run 'agl-no-such-program-here'" in capsys.readouterr().err


def test_table_refuses_a_file_that_is_not_a_report(tmp_path: Path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    assert main(["harness", "table", str(bad)]) == 2
    assert f"{bad}: not a report of `agl harness check --json`" in capsys.readouterr().err
