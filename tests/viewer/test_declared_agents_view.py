"""The viewer shows agents as the harness named them: each call's declared agent in the API's
placements and on the rollout page's call tree, and where the prefix-built tree disagrees with them."""

from __future__ import annotations

import urllib.parse

import pytest

from agl_trainer.assembly.assemble import DECLARED_OTHER_AGENT
from agl_trainer.store import RolloutStore
from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import reward_span, rollout_span
from tests.dataplane.test_declared_structure import AGREEING, MAIN, declared
from tests.support.required import requires
from tests.viewer import browser
from tests.viewer.conftest import get, start


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "rollouts.db"
    with RolloutStore(path, grace_s=0.0) as store:
        ingest(store, [*declared({**AGREEING, 4: MAIN}, compaction=(5,)), reward_span("r", 1.0), rollout_span("r")])
        store.refresh_completion()
    return path


def test_the_api_gives_each_call_s_declared_agent_and_disagreement(store_path):
    with start(store_path, index=False) as server:
        status, body = get(server, "/api/rollout?id=r")
    assert status == 200
    agents = {p["call_seq"]: p["agent_id"] for p in body["placements"]}
    assert agents == {0: "main", 1: "main", 2: "sub-1", 3: "main", 4: "main", 5: "main", 6: "main"}
    assert {p["call_seq"]: p["declared"] for p in body["placements"] if p["declared"]} == {4: DECLARED_OTHER_AGENT}
    assert {c["call_seq"]: c["extra"].get("parent_agent_id") for c in body["calls"]}[2] == "main"


EXECUTABLE, WHY = browser.chromium()


@pytest.mark.slow
@requires(EXECUTABLE is not None, WHY)
def test_the_call_tree_names_agents_and_marks_disagreements(store_path):
    with start(store_path, index=False) as server:
        url = server.url + "#/rollout?" + urllib.parse.urlencode({"id": "r"})
        dom = browser.dump_dom(EXECUTABLE, url, expect="agent sub-1")
    assert "agent sub-1" in dom and "agent main" in dom
    assert f"declared tree: {DECLARED_OTHER_AGENT}" in dom
