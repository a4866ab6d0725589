"""Receipts of training's validation rounds (loop/validation.py): the same receipt and results as
`agl eval` writes, one pair per pass of a round, in OUTPUT_DIR/receipts/:

    val-step000020-greedy.{results,receipt}.json    mode val (sampling.val), k = loop.val_repeats
    val-step000020-sampled.{results,receipt}.json   mode train (sampling.train), k = loop.val_sampled

The model is the policy being trained: model.path's hash names the weights it started from, with
the step and policy version the round measured (the checkpoint of that step, when one was saved,
holds those weights)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from agl import semconv

from agl_trainer.eval.receipt import build_receipt, model_hash, write_result
from agl_trainer.eval.scores import TaskScore, summarize

RECEIPTS_DIR = "receipts"


@functools.lru_cache(maxsize=4)
def _base_hash(path: str) -> tuple[str, int]:
    return model_hash(Path(path))  # once per run: the starting weights do not change


def write_round_receipts(
    config: Any,
    out: Path,
    *,
    step: int,
    version: int,
    specs: list[Any],
    rewards: dict[str, float],
    started_at: str,
    ended_at: str,
) -> list[Path]:
    written = []
    loop = config.loop
    passes = (("greedy", semconv.MODE_VAL, loop.val_repeats), ("sampled", semconv.MODE_TRAIN, loop.val_sampled))
    for name, mode, k in passes:
        chosen = [spec for spec in specs if spec.mode == mode]
        if not chosen or k <= 0:
            continue
        scores: dict[str, TaskScore] = {}
        for spec in chosen:
            scores.setdefault(spec.task_id, TaskScore(spec.task_id, [])).rewards.append(rewards.get(spec.rollout_id))
        summary, rows = summarize(list(scores.values()), config.eval.pass_reward, k)
        results = {"summary": summary, "tasks": rows, "step": step, "policy_version": version}
        digest, files = _base_hash(str(config.model.path))
        model = {
            "path": str(Path(str(config.model.path)).resolve()),
            "name": config.model.name,
            "sha256": None,  # the weights trained so far exist only in memory
            "base_sha256": digest,
            "files": files,
            "step": step,
            "policy_version": version,
        }
        receipt = build_receipt(
            config, kind="validation", model_path=None, served_url=None, tasks_path=str(config.val_tasks), k=k,
            mode=mode, seed=None, started_at=started_at, ended_at=ended_at, results=results, model=model,
            extra={"step": step, "policy_version": version},
        )  # fmt: skip
        stem = f"val-step{step:06d}-{name}"
        written.append(write_result(out / RECEIPTS_DIR, results, receipt, stem=stem))
    return written
