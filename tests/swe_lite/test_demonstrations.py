"""swe-lite's demonstrations: the scripted policy's replies parse as mini-swe-agent actions, its sed
fixes every bug the generator makes, a recorded trajectory is mini-swe-agent's own format with the
agent's real observations (the tests pass after the fix), demonstrations search for the file only when
asked to (and then never write its path), and the warm start learns exactly the assistant turns."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from examples.swe_lite.demonstrations import (
    chat_messages, found_by_search, hintless_opening, load_trajectory, record, replies, training_tokens,
)
from examples.swe_lite.functions import FUNCTIONS
from examples.swe_lite.generate import Module, generate, render, write_tasks

ACTION = r"```mswea_bash_command\s*\n(.*?)\n```"  # mini-swe-agent's text-based action regex


def command(text: str) -> str:
    from minisweagent.models.utils.actions_text import parse_regex_actions

    (action,) = parse_regex_actions(text, action_regex=ACTION, format_error_template="bad")
    return action["command"]


def test_demonstrations_look_fix_test_submit_and_never_search() -> None:
    task = generate("demo", 1, seed=0)[0]
    shown = [command(r) for r in replies(task)]
    assert [c.split()[0] for c in shown] == ["cat", "sed", "python", "echo"]
    searched = [command(r) for r in replies(task, search=True)]
    assert searched[0] == f'grep -rn "def {task["placement"]["function"]}" .' and searched[1:] == shown
    assert [c.split()[0] for c in (command(r) for r in replies(task, fix=False))] == ["cat", "python", "echo"]
    tested_first = [command(r) for r in replies(task, tests_first=True)]
    assert tested_first[0] == "python -m pytest -q tests" and tested_first[1:] == shown
    # naming the file by a search: the same commands, the path written as the search for the function
    located = [command(r) for r in replies(task, tests_first=True, locate=True)]
    search = found_by_search(task["placement"]["function"])
    assert located == [c.replace(task["fix"]["path"], search) for c in tested_first] and located != tested_first


@pytest.mark.parametrize("locate", [False, True], ids=["path", "search"])
@pytest.mark.parametrize("function", FUNCTIONS, ids=[f.name for f in FUNCTIONS])
def test_the_scripted_sed_fixes_every_bug(function, locate: bool, tmp_path: Path) -> None:
    values = {k: v[0] for k, v in function.constants.items()}
    module = Module("m", ((function, values),))
    # What a search must not find: the tests that call the function, and a function whose name starts with its name
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(f"from pkg import m\n\n\ndef test_{function.name}_0():\n    m.{function.name}\n")
    (tmp_path / "pkg").mkdir()
    decoy = f"def {function.name}_twice(x):\n    return 2 * x\n"
    (tmp_path / "pkg" / "other.py").write_text(decoy)
    for bug in function.bugs:
        target = tmp_path / "pkg" / "m.py"
        target.write_text(module.source((function.name, bug)))
        task = {"fix": {"path": "pkg/m.py", "buggy": render(bug.buggy, values), "correct": render(bug.correct, values)},
                "placement": {"function": function.name}}  # fmt: skip
        looked, sed = (command(r) for r in replies(task, locate=locate)[:2])
        shown = subprocess.run(["bash", "-c", looked], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
        assert shown == target.read_text(), looked  # the buggy module, and nothing else
        subprocess.run(["bash", "-c", sed], cwd=tmp_path, check=True)
        assert target.read_text() == module.source(), (bug, sed)
    assert (tmp_path / "pkg" / "other.py").read_text() == decoy


@pytest.fixture(scope="module")
def trajectory(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("demo")
    (row,) = (json.loads(line) for line in write_tasks(generate("demo", 1, seed=5), out / "tasks").read_text().splitlines())
    return load_trajectory(record(row, out / "demos"))


def test_a_recorded_demonstration_is_a_real_mini_swe_agent_trajectory(trajectory: dict) -> None:
    assert trajectory["trajectory_format"] == "mini-swe-agent-1.1"
    assert trajectory["info"]["exit_status"] == "Submitted"
    messages = chat_messages(trajectory)
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * 3 + ["assistant"]
    looked, fixed, tested = (messages[i]["content"] for i in (3, 5, 7))
    assert looked.startswith("rc=0\ndef ") and fixed == "rc=0\n"
    assert tested.startswith("rc=0") and " passed" in tested and "failed" not in tested  # the fix worked


def test_a_tests_first_demonstration_sees_the_failing_test_name_the_module(tmp_path: Path) -> None:
    (row,) = (json.loads(line) for line in write_tasks(generate("demo", 1, seed=5), tmp_path / "tasks").read_text().splitlines())
    shown = load_trajectory(record(row, tmp_path / "demos", tests_first=True))
    assert shown["info"]["exit_status"] == "Submitted" and shown["info"]["swe_lite"]["tests_first"] is True
    messages = chat_messages(shown)
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "user"] * 4 + ["assistant"]
    before, after = messages[3]["content"], messages[9]["content"]
    module = row["placement"]["module"]
    assert before.startswith("rc=1") and f"FAILED tests/test_{module}.py::" in before  # what a task with no file named needs
    assert after.startswith("rc=0") and " passed" in after and "failed" not in after

    from agl_trainer.models.tiny import build_bpe_tokenizer

    # The opening on the bare statement: what a training task's first turn shows, and the same first reply
    opening = hintless_opening(shown)
    (bare,) = generate("demo", 1, seed=5, hint="none")
    assert [m["content"] for m in opening["messages"]] == [messages[0]["content"], bare["problem_statement"], messages[2]["content"]]
    tokenizer = build_bpe_tokenizer()
    ids, mask = training_tokens(opening, tokenizer)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == messages[2]["content"] + "<|im_end|>"


def test_a_searching_demonstration_never_writes_the_path(tmp_path: Path) -> None:
    """Recorded by mini-swe-agent in its sandbox: the search finds the module, the fix passes the tests, and
    no reply writes the package or module name (the part of a path a tiny model copies wrong)."""
    (row,) = (json.loads(line) for line in write_tasks(generate("demo", 1, seed=5), tmp_path / "tasks").read_text().splitlines())
    shown = load_trajectory(record(row, tmp_path / "demos", tests_first=True, locate=True))
    assert shown["info"]["exit_status"] == "Submitted" and shown["info"]["swe_lite"]["locate"] is True
    messages = chat_messages(shown)
    function, (package, module) = row["placement"]["function"], row["fix"]["path"][:-3].split("/")
    assert messages[3]["content"].startswith("rc=1") and f"FAILED tests/test_{module}.py::" in messages[3]["content"]
    assert messages[5]["content"].startswith("rc=0") and f"def {function}(" in messages[5]["content"]  # the module read
    assert messages[9]["content"].startswith("rc=0") and " passed" in messages[9]["content"] and "failed" not in messages[9]["content"]
    said = [m["content"] for m in messages if m["role"] == "assistant"]
    assert not any(package in reply or module in reply for reply in said), said


def test_an_opening_that_does_not_run_the_tests_is_refused(trajectory: dict) -> None:
    with pytest.raises(ValueError, match="does not run the tests"):
        hintless_opening(trajectory)  # recorded without tests_first: its first reply reads the file


def test_the_warm_start_learns_the_assistant_turns_only(trajectory: dict) -> None:
    from agl_trainer.models.tiny import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer()
    ids, mask = training_tokens(trajectory, tokenizer)
    assert ids == list(tokenizer.apply_chat_template(chat_messages(trajectory), tokenize=True, return_dict=False))
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    replies_text = [m["content"] + "<|im_end|>" for m in chat_messages(trajectory) if m["role"] == "assistant"]
    assert learned == "".join(replies_text)


def test_with_observations_the_warm_start_learns_everything_after_the_system_prompt(trajectory: dict) -> None:
    from agl_trainer.models.tiny import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer()
    messages = chat_messages(trajectory)
    ids, mask = training_tokens(trajectory, tokenizer, observations=True)
    assert ids == training_tokens(trajectory, tokenizer)[0]  # the same tokens, more of them learned
    system = len(tokenizer.apply_chat_template(messages[:1], tokenize=True, return_dict=False))
    assert mask == [0] * system + [1] * (len(ids) - system)
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert messages[1]["content"] in learned and messages[3]["content"] in learned  # the task, pytest's output
    assert messages[0]["content"] not in learned


def test_the_agents_pytest_loads_no_third_party_plugins(tmp_path: Path) -> None:
    """agent.yaml's environment reaches each bash command: pytest without the venv's plugins (3.5 s
    a run otherwise, most of a demonstration's recording and of a rollout's test step)."""
    from examples.swe.harness import load_agent_config, make_environment
    from examples.swe.swe_task import fresh_copy, parse_task
    from examples.swe_lite.demonstrations import AGENT_CONFIG

    (row,) = (json.loads(line) for line in write_tasks(generate("demo", 1, seed=3), tmp_path / "tasks").read_text().splitlines())
    workspace = fresh_copy(parse_task(row), tmp_path / "repo")
    result = make_environment(load_agent_config(AGENT_CONFIG), workspace, "none").execute({"command": "python -m pytest tests"})
    assert "test session starts" in result["output"] and "plugins:" not in result["output"], result["output"]


def test_a_file_that_is_not_a_trajectory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    for kept in ({"messages": []}, [], {"trajectory_format": "mini-swe-agent-1.1", "messages": {}}):
        path.write_text(json.dumps(kept))
        with pytest.raises(ValueError, match="not a mini-swe-agent-1.1 trajectory"):
            load_trajectory(path)


@pytest.mark.slow
def test_prepare_writes_the_tasks_the_demonstrations_and_a_warm_started_model(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    import torch

    from examples.swe_lite.prepare import main, prepare_swe_lite

    prepared = prepare_swe_lite(
        tmp_path, seed=0, demos=2, steps=3, continue_steps=2, train=10, held_out=4, openings=1, located=1
    )  # fmt: skip
    assert len(prepared.train_tasks.read_text().splitlines()) == 10
    assert sorted(prepared.held_out_tasks) == ["test", "val"]
    assert [len(path.read_text().splitlines()) for path in prepared.held_out_tasks.values()] == [4, 4]
    shown = [load_trajectory(p)["info"] for p in prepared.demos]
    assert [i["exit_status"] for i in shown] == ["Submitted"] * 2
    assert [i["swe_lite"]["locate"] for i in shown] == [False, True]  # the last one names the file by a search
    assert prepared.model == tmp_path / "model-warm"
    assert AutoConfig.from_pretrained(prepared.model).max_position_embeddings == 2048
    tokenizer = AutoTokenizer.from_pretrained(prepared.model)
    assert len(training_tokens(load_trajectory(prepared.demos[0]), tokenizer)[0]) < 1024  # fits with room for searching

    # The second pass moved the first pass's weights, and running it alone from the first pass
    # (`--continue-from`) is the same computation: the same examples in the same order, the same schedule.
    first, second = weights(tmp_path / "model-warm-first"), weights(prepared.model)
    assert any(not torch.equal(first[name], second[name]) for name in first)
    assert main(["--out", str(tmp_path), "--continue-from", str(tmp_path / "model-warm-first"),
                 "--continue-to", str(tmp_path / "again"), "--continue-steps", "2", "--openings", "1"]) == 0  # fmt: skip
    again = weights(tmp_path / "again")
    assert sorted(again) == sorted(second) and all(torch.equal(again[name], second[name]) for name in second)
    assert AutoTokenizer.from_pretrained(tmp_path / "again").get_vocab() == tokenizer.get_vocab()


def weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def test_what_depends_on_the_machine_is_canonical_in_what_the_warm_start_reads() -> None:
    # Two recordings of one demonstration under different load and address layouts (pytest's wall time,
    # CPython's object addresses, one cut by the observation's truncation): the same text once
    # canonical, so the tokenizer and the warm start depend on the seed alone.
    def observation(seconds: str, address: str) -> str:
        return (
            f"rc=1\n{address[-10:]}> = bofofu.to_fahrenheit\n"
            f"E        +  where 12 = <function clamp at {address}>(12, 0, 10)\n"
            f"FAILED tests/test_tomima.py::test_clamp_2 - assert 12 == 10\n1 failed, 12 passed in {seconds}s"
        )

    first, second = observation("0.04", "0x7fe6ee2a8ea0"), observation("12.31", "0x7f0d241b4ea0")
    reply = "THOUGHT: at 0x7fe6ee2a8ea0> the bug.\n\n```mswea_bash_command\ncat fara.py\n```"

    def trajectory(seen: str) -> dict:
        return {"messages": [{"role": "user", "content": seen}, {"role": "assistant", "content": reply},
                             {"role": "exit", "content": ""}]}  # fmt: skip

    canonical = chat_messages(trajectory(first))
    assert canonical == chat_messages(trajectory(second))
    assert canonical[0]["content"] == (
        "rc=1\n0000000000> = bofofu.to_fahrenheit\nE        +  where 12 = <function clamp at 0x000000000000>(12, 0, 10)\n"
        "FAILED tests/test_tomima.py::test_clamp_2 - assert 12 == 10\n1 failed, 12 passed in 0.01s"
    )
    assert canonical[1]["content"] == reply  # the agent's own words are what it learns: never rewritten
    assert chat_messages(trajectory("rc=0\n3 passed")) == [{"role": "user", "content": "rc=0\n3 passed"},
                                                            {"role": "assistant", "content": reply}]  # fmt: skip
