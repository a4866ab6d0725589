"""The demo task: seeded tasks, the tool, the reward, and token ids equal to the chat template's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from examples.demo import task as demo
from examples.demo.episodes import DemoTokens
from examples.demo.tasks import main as main_tasks

REPO = Path(__file__).resolve().parents[2]


def test_tasks_are_seeded() -> None:
    assert demo.make_tasks(20, seed=3) == demo.make_tasks(20, seed=3)
    assert demo.make_tasks(20, seed=3) != demo.make_tasks(20, seed=4)
    tasks = demo.make_tasks(200, seed=0)
    assert len({t["task_id"] for t in tasks}) == 200
    assert {t["key"] for t in tasks} == set(demo.KEYS)
    assert all(
        set(t["table"]) == set(demo.KEYS) and set(t["table"].values()) <= set(demo.VALUES) for t in tasks
    )


def test_tasks_cli_writes_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "tasks.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "examples.demo.tasks", "--n", "5", "--seed", "2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == demo.make_tasks(5, seed=2)
    bad = subprocess.run(
        [sys.executable, "-m", "examples.demo.tasks", "--n", "0"],
        cwd=REPO,
        capture_output=True,
        check=False,
        text=True,
    )
    assert bad.returncode == 2 and "--n must be >= 1" in bad.stderr


def test_tool_and_reward() -> None:
    task = {"task_id": "t", "key": "k3", "table": {"k3": "v5", "k1": "v2"}}
    assert demo.run_tool(task, "call k3") == "v5"
    assert demo.run_tool(task, "call k1 k1") == "v2"  # the tool reads the key the model named
    assert demo.run_tool(task, "k3 call") == demo.NO_VALUE
    perfect = demo.episode_reward(task, ["call", "k3", demo.EOS], ["v5", demo.EOS])
    assert perfect == 1.0
    assert demo.episode_reward(task, [], []) == 0.0
    # 'call k1 <eos>' then the value of k1: only `call` and the two EOS positions are right
    assert demo.episode_reward(task, ["call", "k1", demo.EOS], ["v2", demo.EOS]) == pytest.approx(3 / 5)
    assert demo.generated_words("call k3", "stop") == ["call", "k3", demo.EOS]
    assert demo.generated_words("call k3 k3", "length") == ["call", "k3", "k3"]


def test_check_task_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="'key'"):
        demo.check_task({"table": {}})
    with pytest.raises(ValueError, match="'table'"):
        demo.check_task({"key": "k1", "table": {"k2": "v1"}})


def test_token_ids_match_the_chat_template(prepared) -> None:
    tokenizer = AutoTokenizer.from_pretrained(prepared.path)
    tokens = DemoTokens(tokenizer)

    def render(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for task in demo.make_tasks(10, seed=5):
        p1 = tokens.prompt1(task)
        assert p1 == render(demo.first_messages(task))
        for call in (
            [tokens.vocab["call"], tokens.vocab[task["key"]], tokens.end],
            [tokens.vocab["v1"]] * 3,
            [tokens.end],
        ):
            text = tokenizer.decode(call, skip_special_tokens=True)
            answer = demo.run_tool(task, text)
            assert tokens.prompt2(task, p1, call, answer) == render(demo.second_messages(task, text, answer))
        demo_seq = tokens.demonstration(task)
        learned = [t for t, m in zip(demo_seq.token_ids, demo_seq.loss_mask) if m]
        assert tokenizer.convert_ids_to_tokens(learned) == [
            "call",
            task["key"],
            "<|im_end|>",
            task["table"][task["key"]],
            "<|im_end|>",
        ]
    assert len(tokenizer) <= 26  # the vocabulary the experiment in ENVIRONMENT.md used


def _shown(tasks: list[dict]) -> set[tuple[str, str]]:
    """Every (key, value) a training episode can show: any key the model may look up, its value."""
    return {(key, value) for task in tasks for key, value in task["table"].items()}


def _answer(task: dict) -> tuple[str, str]:
    """All the model sees that decides a task's answer: the key and the value the tool gives."""
    return task["key"], task["table"][task["key"]]


def test_held_out_tasks_show_the_model_no_pair_the_training_shows(tmp_path, prepared) -> None:
    """What the demo writes as held-out (its validation rounds) holds (key, value) pairs that no
    training task nor warm-start demonstration holds under any key, and whose episode's tokens no
    training episode has; yet every key and value is trained (generalisation, not unseen words).
    The old generator (another seed's tables, whole tables excluded) failed this: 26 of its 32
    held-out tasks' pairs were in training tables."""
    from examples.demo.prepare import warm_start_tasks
    from examples.demo.run import held_out_description, write_val_tasks

    train = [*demo.make_tasks(256, 0), *warm_start_tasks(0)]
    path = write_val_tasks(tmp_path / "val.jsonl", 32, 0, exclude=train)
    held_out = [json.loads(line) for line in path.read_text().splitlines()]
    pairs = {_answer(t) for t in held_out}
    assert not pairs & _shown(train) and len(pairs) == 16
    assert len(held_out) == 32 and [t["task_id"] for t in held_out] == [f"test-{i:05d}" for i in range(32)]
    assert {k for k, _ in _shown(train)} == set(demo.KEYS)
    assert {v for _, v in _shown(train)} == set(demo.VALUES)
    tokens = DemoTokens(AutoTokenizer.from_pretrained(prepared.path))
    trained_ids = {tuple(tokens.demonstration(t).token_ids) for t in train}
    assert not {tuple(tokens.demonstration(t).token_ids) for t in held_out} & trained_ids
    # the validation split (for choosing settings) is disjoint from the test split and from training
    val = demo.make_tasks(64, 5, "val")
    assert {_answer(t) for t in val} == set(demo.split_pairs("val")) and not set(demo.split_pairs("val")) & (
        pairs | _shown(train)
    )
    assert "16 (key, value) pairs the training never shows" in held_out_description(32)
    # a task set that does show a held-out pair is refused, named, not silently written
    leaky = [{**held_out[0], "task_id": "demo-x"}]
    with pytest.raises(ValueError, match=r"held-out pairs \[\('k"):
        write_val_tasks(tmp_path / "val2.jsonl", 32, 0, exclude=leaky)


def test_a_task_of_a_split_holds_only_that_split_s_pair(tmp_path) -> None:
    for split in demo.SPLITS:
        for task in demo.make_tasks(50, 1, split):
            assert demo.split_of(*_answer(task)) == split
            assert all(demo.split_of(k, v) == "train" for k, v in task["table"].items() if k != task["key"])
    with pytest.raises(ValueError, match="split must be one of train, val, test"):
        demo.make_tasks(2, 0, "holdout")  # type: ignore[arg-type]
    out = tmp_path / "test.jsonl"
    assert main_tasks(["--n", "4", "--split", "test", "--out", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == demo.make_tasks(4, 0, "test")
