"""`--script FILE`: the turns a user writes (YAML or JSON), and a clear error for a file that cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.cli import main
from agl_trainer.harness_check.script import DEFAULT_TURN, ScriptError, ToolCall, Turn, load_script


def test_yaml_and_json_scripts_give_the_same_turns_then_the_default(tmp_path: Path):
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text(
        "turns:\n"
        "  - tool_calls: [{name: Bash, arguments: {command: echo hello}}]\n"
        "  - reasoning: It printed hello.\n    content: Done.\n"
        "  - Just text.\n"
    )
    json_file = tmp_path / "s.json"
    json_file.write_text(
        '{"turns": [{"tool_calls": [{"name": "Bash", "arguments": {"command": "echo hello"}}]},'
        ' {"reasoning": "It printed hello.", "content": "Done."}, "Just text."]}'
    )
    for path in (yaml_file, json_file):
        script = load_script(path)
        assert [script.next_turn() for _ in range(4)] == [
            (0, Turn(tool_calls=[ToolCall("Bash", {"command": "echo hello"})])),
            (1, Turn(content="Done.", reasoning="It printed hello.")),
            (2, Turn(content="Just text.")),
            (None, DEFAULT_TURN),
        ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- just a list\n", "Expected `object`, got `array`"),
        ("turns:\n  - {content: hi, delay: 3}\n", "Object contains unknown field `delay` - at `$.turns[0]`"),
        ("turns:\n  - {tool_calls: [{arguments: {}}]}\n", "Object missing required field `name`"),
        ("turns:\n  - {reasoning: only thinking}\n", "turn 0 has neither content nor tool_calls"),
        ("turns: [content: [\n", "not YAML or JSON"),
    ],
)
def test_a_script_that_cannot_be_used_is_named_with_the_problem(tmp_path: Path, text: str, message: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ScriptError) as caught:
        load_script(path)
    assert str(caught.value).startswith(f"--script {path}: ") and message in str(caught.value)


def test_the_cli_turns_a_bad_script_into_a_usage_error_before_running_anything(tmp_path, capsys):
    marker = tmp_path / "ran"
    code = main(["harness", "check", "--script", str(tmp_path / "missing.yaml"), "--", "touch", str(marker)])
    assert code == 2 and not marker.exists()
    assert "agl: error: --script" in capsys.readouterr().err
