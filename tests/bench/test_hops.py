"""The normalization bench's task (bench/_hops.py) and how bench/normalization.py turns its
rollouts into training input for each aggregation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench._hops import MAX_HOPS, Hop, Rollout, expected_hops, make_chain_tasks, rows, score
from bench.normalization import MODES, results_for
from examples.demo import task as demo


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from examples.demo.episodes import DemoTokens
    from examples.demo.model import build_demo_model

    return DemoTokens(AutoTokenizer.from_pretrained(build_demo_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)))


def test_chains_point_onward_and_end_on_a_value() -> None:
    tasks = make_chain_tasks(200, seed=3)
    assert tasks == make_chain_tasks(200, seed=3) and tasks != make_chain_tasks(200, seed=4)
    assert {t["hops"] for t in tasks} == set(range(1, MAX_HOPS + 1))
    for task in tasks:
        hops = expected_hops(task)
        assert len(hops) == task["hops"] and hops[0][0][1] == task["key"]
        answers = [answer[0] for _, answer in hops]
        assert all(a in demo.KEYS for a in answers[:-1]) and answers[-1] in demo.VALUES
        assert [call[1] for call, _ in hops[1:]] == answers[:-1]  # each hop looks up the previous answer


def right_hop(tokens, key: str, answer: str) -> Hop:
    v = tokens.vocab
    p1 = tokens.prompt1({"key": key})
    c1 = [v["call"], v[key], tokens.end]
    p2 = tokens.prompt2({}, p1, c1, answer)
    c2 = [v[answer], tokens.end]
    return Hop(p1, c1, p2, c2, tokens.generated_words(c1), tokens.generated_words(c2))


def test_one_sample_per_hop_with_exactly_the_generated_tokens_trained(tokens) -> None:
    task = next(t for t in make_chain_tasks(50, seed=1) if t["hops"] == 3)
    hops = [right_hop(tokens, call[1], answer[0]) for call, answer in expected_hops(task)]
    assert score(task, hops) == 1.0
    assert score(task, hops[:1]) == pytest.approx(1 / 3)  # stopped after one of three hops
    samples = rows(Rollout(task, hops))
    assert len(samples) == 3  # a fresh context per hop breaks the merge: one sample each
    for (ids, mask), hop in zip(samples, hops):
        assert ids == [*hop.prompt2, *hop.call2]
        trained = [t for t, m in zip(ids, mask) if m]
        assert trained == [*hop.call1, *hop.call2]  # both calls of the hop, nothing else


def test_a_hop_whose_calls_do_not_merge_makes_two_rows(tokens) -> None:
    hop = right_hop(tokens, "k1", "v2")
    hop.prompt2 = hop.prompt2[:3] + hop.prompt2[4:]  # a harness that rewrote the history
    assert len(rows(Rollout({"hops": 1}, [hop]))) == 2


def test_sample_level_weighs_a_rollout_by_its_samples_rollout_level_does_not(tokens) -> None:
    from agl_trainer.algorithms import token_weights
    from agl_trainer.batch import TrainingBatch

    task = {"id": "t", "key": "k1", "hops": 3}
    long = Rollout(task, [right_hop(tokens, "k1", "k2"), right_hop(tokens, "k2", "k3"), right_hop(tokens, "k3", "v1")])
    short = Rollout(task, [right_hop(tokens, "k1", "v5")])
    long.reward, short.reward = 1.0, 0.0
    share = {}
    for mode, (agg, per_rollout) in MODES.items():
        results = results_for(mode, [long, short], 0, tokens)
        assert len(results) == (2 if per_rollout else 4)
        assert {r.reward for r in results if r.rollout_id.split("/")[0] == "r0"} == {1.0}
        batch = TrainingBatch.from_rollouts(results, pad_token_id=tokens.end)
        weights = token_weights(batch.loss_mask, batch.rollout_index, agg)
        owner = torch.tensor([int(results[i].rollout_id.split("/")[0][1:]) for i in batch.rollout_index])
        share[mode] = float(weights[owner == 0].sum() / weights.sum())
    assert share["rollout"] == pytest.approx(0.5)  # every rollout weighs the same
    assert share["sample"] == pytest.approx(0.75)  # 3 of the 4 rows
    assert share["token"] == pytest.approx(0.75)  # 3 of the 4 hops' tokens (every hop has 5)


@pytest.mark.slow
def test_quick_bench_prints_the_table_and_writes_the_curves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.normalization import main

    assert main(["--quick", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for mode in MODES:
        assert f"\n{mode:8} {MODES[mode][0]}" in out
    data = json.loads((tmp_path / "normalization.json").read_text())
    assert [row["mode"] for row in data["table"]] == list(MODES)
    assert all(len(run["entropy"]) == 2 and run["val"][0][0] == 0 for run in data["runs"])
    assert (tmp_path / "normalization.png").read_bytes()[:4] == b"\x89PNG"
