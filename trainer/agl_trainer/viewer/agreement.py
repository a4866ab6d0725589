"""Engine/trainer agreement per token and per sample in the rollout view: each trained token's
engine logprob set against the trainer's (store/agreement_log.py, written when the step trained it),
and tokens whose engine logprob is unknown shown as such (never as 0.0)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from agl_trainer.batch import Sample
from agl_trainer.store.agreement_log import read
from agl_trainer.store.records import RolloutKey


def attach(out: list[dict[str, Any]], samples: list[Sample], run_dir: Path | None, key: RolloutKey) -> None:
    """Adds to each sample's JSON: `logprobs` None where unknown, `logprob_missing`, and with the run's
    agreement log `trainer_logprobs`, `abs_delta` (per token, None where not trained) and `agreement`."""
    logged = read(run_dir, key.rollout_id, key.attempt) if run_dir is not None else {}
    for view, sample in zip(out, samples, strict=True):
        known = np.ones(sample.token_ids.size, bool) if sample.logprob_known is None else sample.logprob_known
        trained = sample.loss_mask
        view["logprob_missing"] = int((trained & ~known).sum())
        if view["logprob_missing"]:
            view["logprobs"] = [v if k else None for v, k in zip(view["logprobs"], known.tolist(), strict=True)]
        entry = logged.get(view["index"])
        if entry is None or entry[2].size != sample.token_ids.size:
            continue  # not trained yet, or another assembly than the trainer's
        step, version, trainer = entry
        engine = sample.engine_logprobs.astype(np.float64)
        measured = trained & known & np.isfinite(trainer)
        delta = np.where(measured, np.abs(trainer - engine), np.nan)
        view["trainer_logprobs"] = [round(float(v), 4) if math.isfinite(v) else None for v in trainer]
        view["abs_delta"] = [round(float(d), 5) if math.isfinite(d) else None for d in delta]
        versions = sample.policy_versions
        view["agreement"] = {
            "step": step,
            "trained_version": version,
            **_summary("lag0", delta[measured & (versions == version)]),
            **_summary("stale", delta[measured & (versions >= 0) & (versions < version)]),
        }


def _summary(name: str, deltas: np.ndarray) -> dict[str, Any]:
    if deltas.size == 0:
        return {f"{name}_tokens": 0}
    return {
        f"{name}_tokens": int(deltas.size),
        f"{name}_mean_abs_delta": float(deltas.mean()),
        f"{name}_max_abs_delta": float(deltas.max()),
    }
