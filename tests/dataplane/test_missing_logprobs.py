"""Calls stored without usable logprobs (NaN: the receiver drops them; -inf: kept as sent) are never
trained with 0.0 as their engine logprob: assembly marks them unknown, the step re-scores the ones
the trained version sampled and leaves the stale ones out of the loss, and counts both."""

from __future__ import annotations

import math

import pytest
import torch
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.backends import TorchBackend
from agl_trainer.batch import TrainingBatch

from tests.algorithms.tiny import make_tiny_model, training_config
from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span


@pytest.mark.slow
def test_nan_and_missing_logprobs_are_rescored_or_excluded_and_counted(store, tmp_path):
    for rid, reward in (("a", 1.0), ("b", 0.0)):
        p0, c0 = [3, 4, 5], [10, 11, 12]
        p1, c1 = p0 + c0 + [6], [13, 14]
        p2, c2 = p1 + c1 + [7], [15, 16, 17]
        ingest(store, [
            call_span(rid, 0, p0, c0, [-0.5, -0.6, -0.7], version=1),
            call_span(rid, 1, p1, c1, [-0.5, float("nan")], version=0),  # stale, logprobs dropped
            call_span(rid, 2, p2, c2, [-0.4, float("-inf"), -0.3], version=1),  # lag 0, one unusable
            rollout_span(rid), reward_span(rid, reward),
        ])  # fmt: skip
    result = assemble(store, store.ready_rollouts(), AssemblyConfig())
    assert result.report.call_problems.get("logprobs_missing") == 2  # call 1 of each rollout
    [sample] = result.rollouts[0].samples
    known = sample.logprob_known
    assert known is not None
    unknown = [i for i, (m, k) in enumerate(zip(sample.loss_mask, known, strict=True)) if m and not k]
    assert unknown == [7, 8, 11]  # call 1's two tokens, call 2's -inf token
    assert all(math.isfinite(v) for v in sample.engine_logprobs)

    backend = TorchBackend(training_config(make_tiny_model(tmp_path / "model"), lr=1e-2))
    batch = TrainingBatch.from_rollouts(result.rollouts)
    metrics = backend.train_step(batch, 1)
    assert metrics["agreement/logprobs_missing_tokens"] == 6  # 3 a rollout
    assert metrics["agreement/logprobs_missing_excluded"] == 4  # version 0, trained at 1: not trained
    assert metrics["agreement/logprobs_missing_rescored"] == 2  # version 1: the pre-update pass scores it
    assert metrics["perf/trained_tokens"] == 2 * (3 + 3)  # calls 0 and 2 of each rollout
    assert math.isfinite(metrics["loss/total"])
    # a re-scored token is weighed as the trainer scores it: no importance correction, no gap
    assert metrics["agreement/lag0/tokens"] == 2 * 5
    assert backend.last_logprobs is not None
    assert bool(torch.isfinite(backend.last_logprobs[0, 11]))  # re-scored: the trainer's logprob stands in
    assert bool(torch.isnan(backend.last_logprobs[0, 7]))  # excluded: not trained
