"""Scores of k attempts a task: pass@k by the unbiased estimator (Chen et al. 2021, "Evaluating Large
Language Models Trained on Code": 1 - C(n-c, k) / C(n, k) for n attempts of which c passed), and
mean@k (the mean reward of the attempts). An attempt that produced no data (harness error, timeout)
counts as reward 0 and not passed: a failure is part of the score; `failed` says how many."""

from __future__ import annotations

import math
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k attempts drawn from the n (c passing) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_reported(n: int) -> list[int]:
    """pass@j for j = 1, 2, 4, ... up to n, and n itself."""
    ks, j = [], 1
    while j < n:
        ks.append(j)
        j *= 2
    return ks + [n]


@dataclass
class TaskScore:
    task_id: str
    rewards: list[float | None]  # per attempt, in attempt order; None: the attempt produced no data

    def summary(self, pass_reward: float) -> dict[str, object]:
        values = [0.0 if r is None else r for r in self.rewards]
        n = len(values)
        passed = sum(v >= pass_reward for v in values)
        row: dict[str, object] = {
            "task_id": self.task_id,
            "rewards": self.rewards,
            "attempts": n,
            "failed": sum(r is None for r in self.rewards),
            "passed": passed,
            "mean": sum(values) / n if n else 0.0,
        }
        for j in ks_reported(n):
            row[f"pass@{j}"] = pass_at_k(n, passed, j)
        return row


def summarize(tasks: list[TaskScore], pass_reward: float, k: int) -> tuple[dict[str, float], list[dict[str, object]]]:
    """(overall, per task): overall mean@k and pass@j are the means over tasks of theirs."""
    rows = [task.summary(pass_reward) for task in tasks]
    overall: dict[str, float] = {
        "tasks": float(len(rows)),
        "k": float(k),
        "attempts": float(sum(int(r["attempts"]) for r in rows)),  # type: ignore[call-overload]
        "failed": float(sum(int(r["failed"]) for r in rows)),  # type: ignore[call-overload]
    }
    if rows:
        overall[f"mean@{k}"] = sum(float(r["mean"]) for r in rows) / len(rows)  # type: ignore[arg-type]
        for j in ks_reported(k):
            overall[f"pass@{j}"] = sum(float(r[f"pass@{j}"]) for r in rows) / len(rows)  # type: ignore[arg-type]
    return overall, rows
