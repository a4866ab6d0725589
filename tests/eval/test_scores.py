"""pass@k by the unbiased estimator, mean@k, and --compare's refusal, on hand-made results."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from agl_trainer.cli import main
from agl_trainer.eval.compare import Incomparable, compare, differences
from agl_trainer.eval.receipt import SCHEMA, read_result, write_result
from agl_trainer.eval.scores import TaskScore, pass_at_k, summarize


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    # It is the mean over every k-subset of the attempts of "one of them passed".
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 8)
        passed = [rng.random() < 0.4 for _ in range(n)]
        k = rng.randint(1, n)
        from itertools import combinations

        subsets = list(combinations(passed, k))
        assert pass_at_k(n, sum(passed), k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="n=2 c=3"):
        pass_at_k(2, 3, 1)


def test_summary_counts_a_failed_attempt_as_zero() -> None:
    overall, rows = summarize([TaskScore("a", [1.0, None, 0.5, 1.0]), TaskScore("b", [0.0, 0.0, 0.0, 0.0])], 1.0, 4)
    assert rows[0]["failed"] == 1 and rows[0]["passed"] == 2 and rows[0]["mean"] == pytest.approx(2.5 / 4)
    assert rows[0]["pass@1"] == pytest.approx(0.5) and rows[0]["pass@2"] == pytest.approx(1 - 1 / 6)
    assert overall["mean@4"] == pytest.approx(2.5 / 8) and overall["pass@4"] == 0.5 and overall["failed"] == 1
    assert math.isclose(overall["pass@1"], 0.25)


def fake_result(directory: Path, *, max_turns: int = 10, temperature: float = 1.0, rewards: list[float]) -> Path:
    overall, rows = summarize([TaskScore(f"t{i}", [r]) for i, r in enumerate(rewards)], 1.0, 1)
    receipt = {
        "schema": SCHEMA,
        "budget": {"k": 1, "max_turns": max_turns, "context_tokens": 0, "max_tokens_per_call": 0, "timeout_s": 60.0,
                   "retries": 0},
        "sampling": {"mode": "train", "temperature": temperature, "top_p": 1.0, "seed": 0},
        "tasks": {"sha256": "ab"},
        "model": {"path": str(directory)},
        "results": {},
    }  # fmt: skip
    return write_result(directory, {"summary": overall, "tasks": rows}, receipt)


def test_compare_side_by_side_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = fake_result(tmp_path / "a", rewards=[0.0, 1.0])
    b = fake_result(tmp_path / "b", rewards=[1.0, 1.0])
    table, found = compare(a.parent, b.parent)
    assert not found
    assert "mean@1" in table and "+0.5000" in table and "t0" in table
    c = fake_result(tmp_path / "c", max_turns=30, temperature=0.7, rewards=[1.0, 1.0])
    assert differences(json.loads(a.read_text()), json.loads(c.read_text())) == [
        "budget.max_turns: 10 vs 30",
        "sampling.temperature: 1.0 vs 0.7",
    ]
    with pytest.raises(Incomparable, match="budget.max_turns: 10 vs 30"):
        compare(a.parent, c.parent)
    assert main(["eval", "--compare", str(a.parent), str(c.parent)]) == 1
    assert "budget.max_turns: 10 vs 30" in capsys.readouterr().err
    assert main(["eval", "--compare", str(a.parent), str(c.parent), "--warn"]) == 0
    captured = capsys.readouterr()
    assert "warning: budget.max_turns" in captured.err and "+0.5000" in captured.out
    # A results file edited after its receipt was written is refused, naming it.
    (tmp_path / "b" / "results.json").write_text((tmp_path / "b" / "results.json").read_text().replace("1.0", "0.9"))
    with pytest.raises(ValueError, match="changed since its receipt"):
        read_result(tmp_path / "b")
    assert main(["eval", "--compare", str(a.parent), str(tmp_path / "nowhere")]) == 2
    assert "no receipt" in capsys.readouterr().err
