"""`agl eval --compare A B`: two results side by side, per task and overall, with B - A.

Both receipts are checked first (receipt.read_result: the results' digest, the results file in the
receipt's folder, the shapes read here). Scores measured under different budgets (turns, context, tokens per call, timeout, k) or sampling
(mode, temperature, top_p) are not comparable: the comparison is refused, naming the fields that
differ, unless asked to warn instead (--warn, or eval.budget_mismatch: warn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agl_trainer.eval.receipt import BUDGET_KEYS, SAMPLING_KEYS, read_result


class Incomparable(ValueError):
    """The two receipts' budgets or sampling differ; the message names each field."""


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """'budget.max_turns: 10 vs 30' for every budget and sampling field that differs."""
    found = []
    for section, keys in (("budget", BUDGET_KEYS), ("sampling", SAMPLING_KEYS)):
        for key in keys:
            left, right = a.get(section, {}).get(key), b.get(section, {}).get(key)
            if left != right:
                found.append(f"{section}.{key}: {left!r} vs {right!r}")
    return found


def compare(path_a: Path, path_b: Path, *, warn: bool = False) -> tuple[str, list[str]]:
    """The side-by-side table and the differences found (Incomparable when they refuse it)."""
    receipt_a, results_a = read_result(path_a)
    receipt_b, results_b = read_result(path_b)
    found = differences(receipt_a, receipt_b)
    if found and not warn:
        raise Incomparable(
            "the two results were measured under different budgets or sampling, so their scores are not "
            f"comparable: {'; '.join(found)} (fix: evaluate both with the same settings, or --warn to compare anyway)"
        )
    lines = [f"A: {path_a} ({_model(receipt_a)})", f"B: {path_b} ({_model(receipt_b)})"]
    if receipt_a["tasks"].get("sha256") != receipt_b["tasks"].get("sha256"):
        found.append("tasks.sha256: the task files differ (only tasks in both are compared per task)")
    summary_a, summary_b = results_a["summary"], results_b["summary"]
    keys = [key for key in summary_a if key in summary_b and (key.startswith(("mean@", "pass@")) or key == "failed")]
    lines.append("")
    lines.append(f"{'overall':<24} {'A':>10} {'B':>10} {'B - A':>10}")
    for key in keys:
        a, b = float(summary_a[key]), float(summary_b[key])
        lines.append(f"{key:<24} {a:>10.4f} {b:>10.4f} {b - a:>+10.4f}")
    rows_a = {row["task_id"]: row for row in results_a["tasks"]}
    rows_b = {row["task_id"]: row for row in results_b["tasks"]}
    k = int(summary_a.get("k", 1))
    pass_key = f"pass@{k}"
    lines.append("")
    lines.append(f"{'task':<24} {'mean A':>10} {'mean B':>10} {'B - A':>10} {pass_key + ' A':>10} {pass_key + ' B':>10}")
    for task_id in [t for t in rows_a if t in rows_b]:
        ra, rb = rows_a[task_id], rows_b[task_id]
        lines.append(
            f"{task_id[:24]:<24} {ra['mean']:>10.4f} {rb['mean']:>10.4f} {rb['mean'] - ra['mean']:>+10.4f} "
            f"{float(ra.get(pass_key, 0.0)):>10.4f} {float(rb.get(pass_key, 0.0)):>10.4f}"
        )
    only = sorted(set(rows_a) ^ set(rows_b))
    if only:
        lines.append(f"({len(only)} tasks in only one of the two are left out)")
    return "\n".join(lines), found


def _model(receipt: dict[str, Any]) -> str:
    model = receipt.get("model", {})
    digest = model.get("sha256")
    where = model.get("path") or model.get("url") or "?"
    return f"{where}, sha256 {str(digest)[:12]}" if digest else str(where)
