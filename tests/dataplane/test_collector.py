"""A real OpenTelemetry collector (rotel-agent) between the sender and `agl receive`, over gRPC and HTTP."""

from __future__ import annotations

import pytest
from agl_trainer.store import RolloutStore

from tests.dataplane.otlp import call_span, request, reward_span, rollout_span
from tests.dataplane.processes import receive_behind_rotel


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spans_through_rotel_into_agl_receive(tmp_path, protocol):
    with receive_behind_rotel(tmp_path, protocol) as receiving:
        prompt = list(range(1000, 5000))  # a long prompt: thousands of AnyValues through the collector
        spans = [
            call_span("via-rotel", 0, prompt, [7, 8, 9]),
            call_span("via-rotel", 1, prompt + [7, 8, 9, 10], [11]),
            reward_span("via-rotel", 1.0),
            rollout_span("via-rotel"),
        ]
        receiving.post_traces(request(spans).SerializeToString(), gzipped=True)
        receiving.wait_stored(4)
        with RolloutStore(receiving.store, grace_s=0.0) as store:
            data = store.load("via-rotel")
            assert [call.prompt_ids.tolist() for call in data.calls] == [prompt, prompt + [7, 8, 9, 10]]
            assert [r.rollout_id for r in store.ready_rollouts()] == ["via-rotel"]
    assert receiving.returncode == 0 and "4 spans stored" in receiving.output
