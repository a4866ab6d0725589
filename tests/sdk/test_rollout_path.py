"""The rollout URL is one contract (agl.semconv.rollout_path): a harness's calls land on the same
rollout id in their spans whether the SDK (`Rollout.base_url`) or a runner (`Endpoint.base_url`,
what OPENAI_BASE_URL is set to) built the URL, whatever characters the id holds."""

from __future__ import annotations

import httpx
import pytest

import agl
from agl import semconv
from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar
from agl_trainer.runners.base import Endpoint, RolloutSpec
from agl_testing.fake_vllm import FakeVLLM

# URL delimiters, an escape that must not be decoded twice, a space, non-ASCII, a query-like tail.
IDS = ["a?b", "a#b", "a%2Fb", "a%b", "50% off", "ünï-文字", "a&b=c;d"]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def no_runner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (semconv.ENV_ROLLOUT_ID, semconv.ENV_TASK_ID, semconv.ENV_ATTEMPT, semconv.ENV_MODE):
        monkeypatch.delenv(name, raising=False)


def test_sdk_and_runner_urls_attribute_a_call_to_the_same_rollout_id(tmp_path, otlp_sink):
    # Before: the runner put the id in the path as it was, so `a?b` reached the sidecar as `a`,
    # `a#b` as `a` and `a%2Fb` as `a/b`: the same rollout's calls split by who built the URL.
    with FakeVLLM() as engine:
        settings = {"listen": "127.0.0.1:0", "spool_dir": str(tmp_path), "export_interval_s": 0.05,
                    "upstream": [engine.base_url], "otlp_endpoint": otlp_sink.endpoint}  # fmt: skip
        with BackgroundSidecar(build(settings)) as sidecar:
            endpoint = Endpoint(sidecar.url)
            sent = []
            for rollout_id in IDS:
                for attempt in (0, 3):
                    sdk_url = agl.rollout(rollout_id=rollout_id, attempt=attempt).base_url(sidecar.url)
                    runner_url = endpoint.base_url(RolloutSpec(rollout_id, "t", {}, attempt))
                    assert sdk_url == runner_url  # one builder, so one URL
                    for url in (sdk_url, runner_url):
                        assert httpx.post(url + "/chat/completions", json=CHAT).status_code == 200
                        sent.append((rollout_id, attempt))
            spans = otlp_sink.wait_for(lambda spans: len(spans) >= len(sent))
    got = [(span.attributes[semconv.ROLLOUT_ID], span.attributes.get(semconv.ATTEMPT, 0)) for span in spans]
    assert sorted(got) == sorted(sent)


def test_a_runner_rollout_id_with_a_slash_in_val_mode_keeps_its_id_and_mode(tmp_path, otlp_sink):
    # The SDK refuses a `/` in an id; a runner's id may hold one (one path segment, encoded).
    # Before: `run/v?1#é` reached the sidecar as `run` with the rest of the path unrouted (404).
    with FakeVLLM() as engine:
        settings = {"listen": "127.0.0.1:0", "spool_dir": str(tmp_path), "export_interval_s": 0.05,
                    "upstream": [engine.base_url], "otlp_endpoint": otlp_sink.endpoint}  # fmt: skip
        with BackgroundSidecar(build(settings)) as sidecar:
            url = Endpoint(sidecar.url).base_url(RolloutSpec("run/v?1#é", "t", {}, 2, semconv.MODE_VAL))
            assert url.endswith("/attempts/2/modes/val/v1")
            assert httpx.post(url + "/chat/completions", json=CHAT).status_code == 200
            (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.ROLLOUT_ID] == "run/v?1#é"
    assert span.attributes[semconv.ATTEMPT] == 2
    assert span.attributes[semconv.ROLLOUT_MODE] == semconv.MODE_VAL


def test_rollout_path_encodes_the_id_as_one_segment():
    assert semconv.rollout_path("r1") == "/rollouts/r1/v1"
    assert semconv.rollout_path("a/b?c#d%", 2, "val") == "/rollouts/a%2Fb%3Fc%23d%25/attempts/2/modes/val/v1"
    assert semconv.rollout_path("é", 0) == "/rollouts/%C3%A9/v1"


def test_sdk_url_carries_a_val_rollouts_mode_as_the_runners_does():
    # Before: the SDK's base_url left the mode out, so a val rollout's calls got train sampling.
    sdk_url = agl.rollout(rollout_id="r?1", attempt=1, mode=semconv.MODE_VAL).base_url("http://h:1")
    runner_url = Endpoint("http://h:1").base_url(RolloutSpec("r?1", "t", {}, 1, semconv.MODE_VAL))
    assert sdk_url == runner_url == "http://h:1/rollouts/r%3F1/attempts/1/modes/val/v1"
    assert agl.rollout(rollout_id="r", mode=semconv.MODE_TRAIN).base_url("http://h:1/v1") == "http://h:1/rollouts/r/v1"
