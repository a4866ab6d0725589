"""algorithms/token_age.py: the token-age rule's bound, weights, buckets and metrics, against values
computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig, AlgorithmConfigError
from agl_trainer.algorithms.token_age import (
    agreement_buckets,
    importance_metrics,
    importance_sums,
    importance_weights,
    rollout_too_old,
    staleness_bound,
    staleness_metrics,
    too_old,
)

# Five tokens: a prompt token (not trained), then tokens of versions 3, 3, 4 (current) and 2.
OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.1]]))
ENGINE = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.5, 0.5]]))
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]])
VERSIONS = torch.tensor([[-1, 3, 3, 4, 2]])


def test_the_bound_unset_is_one_live_and_none_from_a_store() -> None:
    assert staleness_bound(None, live=True) == 1 and staleness_bound(None, live=False) == -1
    assert staleness_bound(0, live=True) == 0 and staleness_bound(3, live=False) == 3
    with pytest.raises(ValueError, match="-1 for no bound"):
        staleness_bound(-2, live=False)


def test_too_old_marks_trained_tokens_past_the_bound_and_of_unknown_age() -> None:
    versions = np.array([-1, 3, 3, 4, 2, 1, -1])
    mask = np.array([0, 1, 1, 1, 1, 0, 1])
    # current 4, bound 1: versions < 3 are too old; the untrained v1 and the prompt never count
    assert too_old(versions, mask, 4, 1).tolist() == [False, False, False, False, True, False, True]
    assert too_old(versions, mask, 4, 0).tolist() == [False, True, True, False, True, False, True]
    assert not too_old(versions, mask, 4, -1).any()  # no bound
    assert rollout_too_old(2, 4, 1) and not rollout_too_old(3, 4, 1) and not rollout_too_old(0, 9, -1)


def test_truncated_weights_apply_to_stale_tokens_only() -> None:
    iw = importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0)
    # token 1: 0.5/0.25 = 2; token 2: 5 capped at 3; token 3 is current (no weight); token 4: 0.1/0.5
    torch.testing.assert_close(iw.weights, torch.tensor([[1.0, 2.0, 3.0, 1.0, 0.2]]))
    assert iw.applied.tolist() == [[False, True, True, False, True]]
    assert iw.capped.tolist() == [[False, False, True, False, False]]
    assert not iw.masked.any()
    every = importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0, scope="all")
    assert every.applied.tolist() == [[False, True, True, True, True]]
    assert not importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, scope="off").applied.any()


def test_the_ratio_mask_keeps_ratios_inside_floor_and_cap_and_drops_the_rest() -> None:
    iw = importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0, rule="ratio_mask", floor=0.5)
    # ratios 2 (kept as is), 5 (> cap: out), current token (1), 0.2 (< floor: out)
    torch.testing.assert_close(iw.weights, torch.tensor([[1.0, 2.0, 0.0, 1.0, 0.0]]))
    assert iw.masked.tolist() == [[False, False, True, False, True]]
    assert iw.capped.tolist() == [[False, False, True, False, False]]
    low = importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0, rule="ratio_mask", floor=0.1)
    torch.testing.assert_close(low.weights, torch.tensor([[1.0, 2.0, 0.0, 1.0, 0.2]]))  # 0.2 >= 0.1 stays
    with pytest.raises(ValueError, match="floor"):
        importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0, rule="ratio_mask", floor=3.0)
    with pytest.raises(AlgorithmConfigError, match="algorithm.importance_floor"):
        AlgorithmConfig(importance_rule="ratio_mask", importance_floor=2.5, importance_cap=2.0)
    with pytest.raises(AlgorithmConfigError, match="algorithm.importance_rule"):
        AlgorithmConfig(importance_rule="clip")


def test_importance_metrics_count_what_was_weighted_capped_and_masked() -> None:
    truncated = importance_sums(importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0))
    masked = importance_sums(importance_weights(OLD, ENGINE, MASK, VERSIONS, 4, cap=3.0, rule="ratio_mask"))
    m = importance_metrics({**truncated[0], "tokens": 4.0}, truncated[1])
    assert m["importance/applied_tokens"] == 3 and m["importance/capped_tokens"] == 1
    assert m["importance/ratio_masked_tokens"] == 0
    assert m["importance/stale_token_frac"] == 0.75 and m["importance/capped_frac"] == pytest.approx(1 / 3)
    assert m["importance/mean"] == pytest.approx((2 + 3 + 0.2) / 3) and m["importance/max"] == pytest.approx(3.0)
    m = importance_metrics({**masked[0], "tokens": 4.0}, masked[1])
    assert m["importance/applied_tokens"] == 3 and m["importance/ratio_masked_tokens"] == 2
    assert m["importance/ratio_masked_frac"] == pytest.approx(2 / 3)
    assert m["importance/mean"] == pytest.approx(2.0) and m["importance/max"] == pytest.approx(2.0)  # the kept one
    assert importance_metrics({"tokens": 4.0}, {})["importance/mean"] == 1.0  # nothing stale


def test_agreement_buckets_by_lag_and_by_the_kv_the_token_was_sampled_over() -> None:
    known = torch.tensor([[True, True, True, True, False, True]])
    versions = torch.tensor([[-1, 4, 3, 4, 4, 3]])
    switched = torch.tensor([[False, False, False, True, False, True]])
    b = agreement_buckets(known, versions, switched, 4)
    assert b["lag0"].tolist() == [[False, True, False, False, False, False]]  # unknown logprob: no bucket
    assert b["stale"].tolist() == [[False, False, True, False, False, False]]
    assert b["keep_kv"].tolist() == [[False, False, False, True, False, True]]  # whatever their lag
    recomputed = agreement_buckets(known, versions, torch.zeros_like(switched), 4)  # switch_kv: recompute
    assert recomputed["lag0"].tolist() == [[False, True, False, True, False, False]]
    assert recomputed["stale"].tolist() == [[False, False, True, False, False, True]]


def test_staleness_metrics_count_every_token_in_the_loss_by_lag() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    versions = torch.tensor([[-1, 9, 8, 8, 3, 9, -1], [7, 9, 1, 1, 1, 1, 1]])
    m = staleness_metrics(mask, versions, 9)
    assert m["staleness/tokens"] == 8 and m["staleness/tokens_unknown"] == 1
    # lags: 0, 1, 1, 6 (-> 4plus), 0, unknown; 2, 0
    assert [m[f"staleness/tokens_lag{k}"] for k in range(4)] == [3, 2, 1, 0] and m["staleness/tokens_lag4plus"] == 1
    total = sum(m[f"staleness/tokens_lag{k}"] for k in range(4)) + m["staleness/tokens_lag4plus"]
    assert total + m["staleness/tokens_unknown"] == m["staleness/tokens"]
    assert m["staleness/max"] == 6 and m["staleness/mean"] == pytest.approx((0 + 1 + 1 + 6 + 0 + 2 + 0) / 7)
    assert m["staleness/stale_token_fraction"] == pytest.approx(4 / 8)
    assert staleness_metrics(torch.zeros(1, 3), versions[:1, :3], 9) == {}
