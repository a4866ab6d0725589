"""SDK values that a span cannot carry, or a URL cannot keep, are refused where they enter with an
error that names them; a rollout id of any printable text reaches the sidecar as itself."""

from __future__ import annotations

import httpx
import pytest

import agl
from agl import semconv
from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar
from agl_trainer.receiver import Receiver, ReceiverConfig
from tests.sdk.test_process import run_python
from agl_testing.fake_vllm import FakeVLLM

ENV = (semconv.ENV_ROLLOUT_ID, semconv.ENV_TASK_ID, semconv.ENV_ATTEMPT, semconv.ENV_MODE)


@pytest.fixture(autouse=True)
def no_runner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_a_rollout_id_with_url_characters_reaches_the_sidecar_as_itself(tmp_path, otlp_sink):
    # Before: base_url put the id in the path as it was: `a?b` and `a#b` were cut (404), `a%2Fb`
    # reached the sidecar as `a/b`, so the calls went to another rollout than the SDK's rewards.
    ids = ["a?b", "a#b", "a%2Fb", "a b", "a%b", "ünï", "a&b=c"]
    with FakeVLLM() as engine:
        settings = {"listen": "127.0.0.1:0", "spool_dir": str(tmp_path), "export_interval_s": 0.05,
                    "upstream": [engine.base_url], "otlp_endpoint": otlp_sink.endpoint}  # fmt: skip
        with BackgroundSidecar(build(settings)) as sidecar:
            for rollout_id in ids:
                url = agl.rollout(rollout_id=rollout_id).base_url(sidecar.url)
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                assert httpx.post(url + "/chat/completions", json=body).status_code == 200
            spans = otlp_sink.wait_for(lambda spans: len(spans) >= len(ids))
    assert [span.attributes[semconv.ROLLOUT_ID] for span in spans] == ids


@pytest.mark.parametrize("rollout_id", [".", "..", "a/b", "a\x00b", "a\nb", "a\ud800b"])
def test_a_rollout_id_a_span_or_a_path_cannot_keep_is_refused(rollout_id):
    with pytest.raises(ValueError, match="rollout_id"):
        agl.rollout(rollout_id=rollout_id)


def test_reward_values_and_texts_a_span_cannot_carry_are_refused_by_name():
    with pytest.raises(ValueError, match="too large for a double"):
        agl.emit_reward(10**400, rollout_id="r")  # was an OverflowError from float()
    with pytest.raises(ValueError, match="rollout_id must be printable"):
        agl.emit_reward(1.0, rollout_id="r\ud800")  # would fail the export of its whole batch
    with pytest.raises(ValueError, match="name must be printable"):
        agl.emit_reward(1.0, rollout_id="r", name="n\x1b[31m")
    with pytest.raises(ValueError, match="attribute 'k'"):
        agl.emit_reward(1.0, rollout_id="r", attributes={"k": "\udcff"})
    with pytest.raises(ValueError, match="outside int64"):
        agl.emit_reward(1.0, rollout_id="r", attributes={"k": 2**70})


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (semconv.ENV_ATTEMPT, "-1", "AGL_ATTEMPT='-1' must be from 0"),  # the receiver refuses it
        (semconv.ENV_ATTEMPT, str(2**64), "must be from 0"),
        (semconv.ENV_MODE, "training", "AGL_ROLLOUT_MODE='training' must be one of"),
        (semconv.ENV_ROLLOUT_ID, "r\udcff", "AGL_ROLLOUT_ID must be printable"),  # an undecodable byte
        (semconv.ENV_TASK_ID, "t\x07", "AGL_TASK_ID must be printable"),
    ],
)
def test_malformed_runner_environment_is_refused_naming_the_variable(monkeypatch, name, value, message):
    if name != semconv.ENV_ROLLOUT_ID:
        monkeypatch.setenv(semconv.ENV_ROLLOUT_ID, "from-env")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        agl.rollout()
    if name != semconv.ENV_MODE:  # a reward carries no mode
        with pytest.raises(ValueError, match=message):
            agl.emit_reward(1.0)


def test_a_malformed_exit_flush_timeout_still_flushes_with_a_clear_warning(otlp_sink):
    # Before: float('abc') raised inside the exit hook: a traceback instead of the flush it guards.
    result = run_python(
        "import agl\nagl.emit_reward(0.5, rollout_id='exit-flush')\n",
        env={semconv.ENV_OTLP_ENDPOINT: otlp_sink.endpoint, semconv.ENV_EXIT_FLUSH_TIMEOUT: "abc"},
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "AGL_EXIT_FLUSH_TIMEOUT_S='abc' is not a number" in result.stderr
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) == 1)
    assert span.attributes[semconv.ROLLOUT_ID] == "exit-flush"



def test_the_standard_otlp_headers_variable_is_percent_decoded_as_its_spec_says(tmp_path):
    # OTEL_EXPORTER_OTLP_HEADERS values are percent-encoded (W3C baggage format), as the OpenTelemetry
    # SDKs read them; taken literally, a receiver behind a token refused every span with a 401.
    with Receiver(tmp_path / "rollouts.db", ReceiverConfig(port=0, token="abc def,1")) as receiver:
        result = run_python(
            "import agl\nagl.emit_reward(0.5, rollout_id='hdr')\n",
            env={
                semconv.ENV_OTLP_ENDPOINT: receiver.url,
                "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc%20def%2C1",
            },
        )
        assert result.returncode == 0, result.stderr
        assert receiver.stats().stored == 1, result.stderr


@pytest.mark.parametrize(
    ("value", "problem"),
    [("localhost:4318", "must start with http://"), ("http://[::1", "is not a valid URL"), ("http://h:99999", "is not a valid URL")],
)
def test_an_otlp_endpoint_the_exporter_cannot_use_is_refused_naming_the_variable(value, problem):
    # Before: every span was lost, the only word "could not deliver ... is the collector running?".
    result = run_python(
        "import agl\nagl.emit_reward(0.5, rollout_id='r')\n", env={semconv.ENV_OTLP_ENDPOINT: value}
    )
    assert result.returncode == 1
    assert f"environment variable AGL_OTLP_ENDPOINT={value!r} {problem}" in result.stderr



def test_the_traces_endpoint_variable_is_used_as_is(monkeypatch):
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the full URL (its spec): agl appended /v1/traces to it.
    from agl._tracing import _traces_url

    for name in (semconv.ENV_OTLP_ENDPOINT, "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/custom/traces")
    assert _traces_url(None) == "http://collector:4318/custom/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")  # the traces one wins
    assert _traces_url(None) == "http://collector:4318/custom/traces"
    monkeypatch.setenv(semconv.ENV_OTLP_ENDPOINT, "http://agl:4318/")
    assert _traces_url(None) == "http://agl:4318/v1/traces"
