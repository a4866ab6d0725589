"""agl.completion.policy_versions (a call generated across a drain-free policy switch): the
receiver's contract checks it, the store keeps it, assembly gives every token its own version, the
loop's staleness bound looks at every token, and `agl traces inspect` shows where versions change."""

from __future__ import annotations

import numpy as np
import pytest
from agl import semconv
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.batch import RolloutResult, Sample

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span
from tests.dataplane.otlp import with_attributes

RUNS = semconv.COMPLETION_POLICY_VERSIONS.replace(".", "__")


def switched(seq: int, prompt: list[int], completion: list[int], runs: list[int], version: int = 3):
    return with_attributes(call_span("r", seq, prompt, completion, version=version), **{RUNS: runs})


def test_tokens_get_the_version_that_sampled_them(store) -> None:
    spans = [
        switched(0, [1, 2], [10, 11, 12, 13, 14, 15], [0, 3, 4, 4]),  # tokens 0-3 by v3, 4-5 by v4
        call_span("r", 1, [1, 2, 10, 11, 12, 13, 14, 15, 7], [20, 21], version=4),  # extends it, at v4
        reward_span("r", 1.0),
        rollout_span("r"),
    ]
    assert ingest(store, spans).violations == {}
    first = store.load("r").calls[0]
    assert first.policy_versions.tolist() == [0, 3, 4, 4]
    [detail] = assemble(store, store.ready_rollouts(), AssemblyConfig()).details
    [sample] = detail.result.samples
    trained = [v for v, m in zip(sample.policy_versions, sample.loss_mask, strict=True) if m]
    assert trained == [3, 3, 3, 3, 4, 4, 4, 4]
    # the tokens v4 sampled inside the call that v3 began (over v3's KV) are marked; call 1's are not
    after = [a for a, m in zip(sample.after_switch, sample.loss_mask, strict=True) if m]
    assert after == [0, 0, 0, 0, 1, 1, 0, 0]


@pytest.mark.parametrize(
    ("runs", "reason"),
    [
        ([3, 0], "policy_versions_starts_not_increasing_from_0"),  # does not start at token 0
        ([0, 3, 2, 4, 2, 5], "policy_versions_starts_not_increasing_from_0"),
        ([0, 3, 6, 4], "policy_versions_start_outside_completion"),  # 6 tokens: starts end at 5
        ([0, 3, 2, -1], "policy_versions_negative"),
        ([0, 3, 2, 5, 4, 4], "policy_versions_decreasing"),  # 5 then 4: a lower resume's leftover
        ([0, 100, 2, 100], "policy_versions_not_from_entry_version"),  # the call entered at 3
        ([0, 2, 2, 3], "policy_versions_not_from_entry_version"),
        ([0, 3, 2], "policy_versions_not_int_pairs"),
        ([], "policy_versions_not_int_pairs"),
    ],
)
def test_the_contract_refuses_bad_runs_naming_the_problem(store, runs, reason) -> None:
    result = ingest(store, [switched(0, [1], [10, 11, 12, 13, 14, 15], runs)])
    assert result.violations == {f"call.{reason}": 1}  # the span is set aside as a violation


def test_the_staleness_bound_looks_at_every_token() -> None:
    from agl_trainer.loop.live import filter_stale

    def result(versions: list[int]) -> RolloutResult:
        n = len(versions)
        sample = Sample(
            rollout_id="r", task_id="t", token_ids=list(range(n)), loss_mask=[1] * n, engine_logprobs=[0.0] * n,
            policy_versions=versions, call_seqs=[0],
        )  # fmt: skip
        return RolloutResult(rollout_id=f"r{versions}", task_id="t", reward=1.0, samples=[sample])

    def filtered(policy: str, results: list[RolloutResult]):  # type: ignore[no-untyped-def]
        return filter_stale(results, 5, 1, masking=policy == "mask")  # version 5, loop.staleness 1

    kept, dropped, masked = filtered("wait", [result([4, 4, 5]), result([3, 4, 5]), result([5, 5])])
    assert [r.rollout_id for r in kept] == ["r[4, 4, 5]", "r[5, 5]"]  # one token at v3 drops its rollout
    assert [r.rollout_id for r in dropped] == ["r[3, 4, 5]"] and masked == 0
    # stale_policy=mask: that token leaves the loss and the rest of its rollout trains; a rollout with
    # nothing left is dropped; tokens outside the loss (prompt, v -1) never count
    partly, wholly, fresh = result([3, 4, 5]), result([2, 3]), result([5, 5])
    partly.samples[0].loss_mask[1] = 0  # the v4 token is not trained anyway
    kept, dropped, masked = filtered("mask", [partly, wholly, fresh])
    assert kept == [partly, fresh] and dropped == [wholly] and masked == 3
    assert partly.samples[0].loss_mask.tolist() == [0, 0, 1] and fresh.samples[0].loss_mask.tolist() == [1, 1]


def test_inspect_shows_where_each_version_starts(store, store_path, capsys, monkeypatch) -> None:
    from agl_trainer.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    ingest(store, [switched(0, [1, 2], [10, 11, 12, 13, 14, 15], [0, 3, 4, 4]), reward_span("r", 1.0), rollout_span("r")])
    assert main(["traces", "inspect", "r", "--store", str(store_path)]) == 0
    out = capsys.readouterr().out
    assert "v3@0 v4@4" in out  # the calls table
    assert out.count("⟦v4⟧") == 1  # and the sample's tokens: once, where version 4 starts
    assert np.array_equal(store.load("r").calls[0].policy_versions, [0, 3, 4, 4])
