"""Per-token engine/trainer agreement in the viewer: the trainer's logprobs a run wrote to its
agreement.db (store/agreement_log.py) set against the engine's, per token and per sample, in the
JSON API and on the rollout page (tokens coloured by |delta| on hover)."""

from __future__ import annotations

import re

import pytest
import torch
from agl_trainer.batch import RolloutResult, Sample
from agl_trainer.store.agreement_log import AgreementLog

from tests.support.required import requires
from tests.viewer import browser
from tests.viewer.conftest import get, start
from tests.viewer.stores import MERGED_ID, build
from tests.viewer.test_browser import rollout_url

EXECUTABLE, WHY = browser.chromium()
GAP = 0.25  # the trainer's logprob is this far from the engine's on every trained token


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("agreement-view")
    store = build(folder / "rollouts.db")
    with start(store) as running:
        status, body = get(running, "/api/rollout?id=" + MERGED_ID)
        assert status == 200 and "agreement" not in body["samples"][0]  # no agreement.db yet
        view = body["samples"][0]
        trained = [role == "c" for role in view["roles"]]
        engine = [lp if lp is not None else 0.0 for lp in view["logprobs"]]
        trainer = torch.tensor([e + GAP if t else float("nan") for e, t in zip(engine, trained, strict=True)])
        sample = Sample(MERGED_ID, "task", view["ids"], [int(t) for t in trained], engine, view["versions"])
        log = AgreementLog(folder)  # as the loop writes it at the step that trained the rollout
        log.write(1, max(view["versions"]), [RolloutResult(MERGED_ID, "task", 1.0, [sample])], trainer.unsqueeze(0))
        log.close()
        yield running


def test_the_api_gives_each_tokens_gap_and_a_summary_per_sample(server):
    status, body = get(server, "/api/rollout?id=" + MERGED_ID)
    assert status == 200
    sample = body["samples"][0]
    trained = [i for i, role in enumerate(sample["roles"]) if role == "c"]
    assert [sample["abs_delta"][i] for i in trained] == pytest.approx([GAP] * len(trained), abs=1e-4)
    assert all(d is None for i, d in enumerate(sample["abs_delta"]) if i not in trained)
    summary = sample["agreement"]
    assert summary["step"] == 1 and summary["lag0_tokens"] + summary["stale_tokens"] == len(trained)
    assert summary["lag0_mean_abs_delta"] == pytest.approx(GAP, abs=1e-4)
    assert sample["logprob_missing"] == 0


def _needs_browser(test):  # skipped without Chromium; under CI=true that fails instead (requires)
    return test if EXECUTABLE is not None else requires(False, WHY)(test)


@pytest.mark.slow
@_needs_browser
def test_the_rollout_page_shows_the_gap_per_token_and_per_sample(server):
    dom = browser.dump_dom(EXECUTABLE, rollout_url(server, MERGED_ID), expect="Engine vs trainer")
    assert "Engine vs trainer (step 1" in dom and "hover the tokens to colour them by |Δ|" in dom
    coloured = re.findall(r'<span class="tok r-c agr" title="([^"]*)" style="--d: ([0-9.]+);"', dom)
    assert coloured and all("|Δ| 0.25" in title for title, _ in coloured)
    assert {float(level) for _, level in coloured} == {GAP / 0.5}
