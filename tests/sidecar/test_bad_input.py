"""Bad input from a harness or an admin client gets a 4xx with a JSON body naming the problem, in the
API's own error shape, before anything reaches the engine; never a 5xx, never a span the receiver
cannot store (an int beyond int64 once blocked a sidecar's whole export), never a call answered 200
whose span is then lost."""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import httpx
import pytest

from agl import semconv

# The first call to a translated API imports its adapter (seconds on a loaded machine).
post = functools.partial(httpx.post, timeout=60)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
DEEP = 2000


def _openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --- ints a span would copy ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "headers", "param"),
    [
        ("/rollouts/r/attempts/99999999999999999999/v1/chat/completions", {}, "attempt in the URL path"),
        ("/rollouts/r/v1/chat/completions", {"x-agl-attempt": str(10**22)}, "x-agl-attempt"),
        ("/rollouts/r/v1/chat/completions", {"x-agl-attempt": "-1"}, "x-agl-attempt"),
        ("/rollouts/r/v1/chat/completions", {"x-agl-attempt": "two"}, "x-agl-attempt"),
        ("/v1/chat/completions", {"baggage": "agl.rollout.id=r,agl.attempt=9223372036854775808"}, "baggage agl.attempt"),
    ],
)
def test_an_attempt_out_of_range_is_refused_naming_its_source(fake, make_sidecar, path, headers, param):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + path, json=CHAT, headers=headers)
    _openai_error(response, 400, param)
    assert fake.requests == []


def test_the_largest_attempt_a_span_can_carry_is_accepted(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    path = f"/rollouts/r/attempts/{2**63 - 1}/v1/chat/completions"
    assert post(sidecar.url + path, json=CHAT).status_code == 200
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.ATTEMPT] == 2**63 - 1


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "max_tokens", 10**30),
        ("/v1/chat/completions", "max_tokens", -(2**63) - 1),
        ("/v1/chat/completions", "n", 2**64),
        ("/v1/chat/completions", "n", 0),
        ("/v1/chat/completions", "top_logprobs", 2**63),
        ("/v1/chat/completions", "max_completion_tokens", 2**70),
        ("/v1/completions", "max_tokens", 10**30),
        ("/v1/completions", "logprobs", 2**64),
    ],
)
def test_request_ints_beyond_int64_are_refused_naming_the_field(fake, make_sidecar, path, field, value):
    sidecar = make_sidecar(upstream=[fake.base_url])
    body = dict(CHAT) if "chat" in path else {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    body[field] = value
    error = _openai_error(post(sidecar.url + path, json=body), 400, field)
    assert "Expected `int`" in error["message"]  # the sidecar's refusal, not the engine's
    assert fake.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"value": 1.0, "call_seq": 2**63}, "call_seq"),
        ({"value": 1.0, "call_seq": -1}, "call_seq"),
        ({"value": 1.0, "attributes": {"k": 10**20}}, "attributes"),
        ({"value": 1.0, "task_id": "t\x1b[2J"}, "task_id"),
        ({"value": 1.0, "name": "a\nb"}, "name"),
    ],
)
def test_reward_values_a_span_cannot_carry_are_refused(fake, make_sidecar, body, param):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + "/rollouts/r/reward", json=body)
    _openai_error(response, 400, param)


# --- ids -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "headers", "param"),
    [
        ("/v1/chat/completions", {"x-agl-rollout-id": b"r\xff"}, "x-agl-rollout-id"),
        ("/rollouts/r/v1/chat/completions", {"x-agl-task-id": b"\xff\xfe"}, "x-agl-task-id"),
        ("/rollouts/r%00x/v1/chat/completions", {}, "rollout id in the URL path"),
        ("/rollouts/r%0d%0ax/v1/chat/completions", {}, "rollout id in the URL path"),
        ("/v1/chat/completions", {"baggage": "agl.rollout.id=a%1Bb"}, "baggage agl.rollout.id"),
    ],
)
def test_ids_that_are_not_printable_text_are_refused_before_the_engine(fake, make_sidecar, otlp_sink, path, headers, param):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    _openai_error(post(sidecar.url + path, json=CHAT, headers=headers), 400, param)
    assert fake.requests == []


def test_a_control_character_in_a_header_is_refused_by_the_http_parser_without_a_traceback(fake, make_sidecar, caplog):
    """aiohttp's parser refuses control characters in header values itself (400, plain text); the
    sidecar logs that as one warning line, not as an error with a traceback."""
    sidecar = make_sidecar(upstream=[fake.base_url])
    with caplog.at_level(logging.WARNING):
        response = post(sidecar.url + "/v1/chat/completions", json=CHAT, headers={"x-agl-rollout-id": "r\x1b[31m"})
    assert response.status_code == 400
    assert fake.requests == []
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("Invalid header value" in r.getMessage() for r in caplog.records)


def test_a_raw_ff_byte_in_the_task_id_of_a_reward_is_a_400(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + "/rollouts/r/reward", json={"value": 1.0}, headers={"x-agl-task-id": b"\xff"})
    _openai_error(response, 400, "x-agl-task-id")
    response = post(sidecar.url + "/rollouts/r/end", json={}, headers={"x-agl-task-id": b"\xff"})
    _openai_error(response, 400, "x-agl-task-id")


def test_non_ascii_ids_are_accepted_and_reach_the_span(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    rollout = "rollout-é-日本"
    response = post(sidecar.url + "/rollouts/" + rollout + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.ROLLOUT_ID] == rollout


# --- bodies --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/chat/completions", b'{"model":"tiny","messages":[' + b"[" * DEEP + b"]" * DEEP + b"]}", "openai"),
        ("/v1/completions", b'{"model":"tiny","prompt":' + b"[" * DEEP + b"]" * DEEP + b"}", "openai"),
        ("/v1/messages", b'{"model":"tiny","max_tokens":4,"messages":' + b"[" * DEEP + b"]" * DEEP + b"}", "anthropic"),
        ("/v1/responses", b'{"model":"tiny","input":' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", "openai"),
        ("/rollouts/r/reward", b'{"value":1,"attributes":' + b"[" * DEEP + b"]" * DEEP + b"}", "openai"),
    ],
)
def test_json_nested_thousands_deep_is_a_400_in_the_apis_shape(fake, make_sidecar, path, body, shape):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    payload = response.json()
    if shape == "anthropic":
        assert payload["type"] == "error" and payload["error"]["message"]
    else:
        assert payload["error"]["message"]
    assert fake.requests == []


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_with_a_json_body(fake, make_sidecar, chunked):
    sidecar = make_sidecar(upstream=[fake.base_url], max_body_bytes=64 * 1024)
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    content: Any = iter([big[:50_000], big[50_000:]]) if chunked else big
    response = post(sidecar.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    error = _openai_error(response, 413)
    assert "65536" in error["message"] and "--max-body-bytes" in error["message"]
    assert fake.requests == []
    # A body under the limit still goes through.
    assert post(sidecar.url + "/v1/chat/completions", json=CHAT).status_code == 200
    # Through an adapter, in its own shape.
    response = post(sidecar.url + "/v1/messages", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["type"] == "error"


def test_the_default_body_limit_is_32_mib():
    from agl_sidecar.config import build

    assert build({"upstream": ["http://127.0.0.1:1"]}).max_body_bytes == 32 * 1024 * 1024


# --- keys ----------------------------------------------------------------------------------------
def test_a_non_ascii_bearer_token_is_a_401_not_a_500(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url], api_key="secret", admin_token="admin")
    for token in ("Bearer sécret".encode(), b"Bearer \xff\xfe", "Bearer 日本".encode()):
        headers = {"Authorization": token}
        response = post(sidecar.url + "/v1/chat/completions", json=CHAT, headers=headers)
        _openai_error(response, 401)
        assert httpx.get(sidecar.url + "/agl/v1/state", headers=headers).status_code == 401
        response = post(sidecar.url + "/v1/messages", json={**CHAT, "max_tokens": 4}, headers={"x-api-key": token[7:]})
        assert response.status_code == 401
    ok = post(sidecar.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200
    assert httpx.get(sidecar.url + "/agl/v1/state", headers={"Authorization": "Bearer admin"}).status_code == 200


# --- admin ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2**64 - 1, 2**63, -1, "3", True, 1.5, None])
def test_resume_refuses_a_policy_version_a_span_cannot_carry(fake, make_sidecar, value):
    sidecar = make_sidecar(upstream=[fake.base_url])
    body = {"policy_version": value} if value is not None else b'{"policy_version": 1e400}'
    kwargs: dict[str, Any] = {"json": body} if value is not None else {"content": body}
    response = post(sidecar.url + "/agl/v1/resume", **kwargs)
    assert response.status_code == 400, response.text
    assert "policy_version" in response.json()["error"]
    assert httpx.get(sidecar.url + "/agl/v1/state").json()["policy_version"] == 0


def test_resume_takes_the_largest_policy_version_a_span_can_carry(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + "/agl/v1/resume", json={"policy_version": 2**63 - 1})
    assert response.status_code == 200 and response.json()["policy_version"] == 2**63 - 1


@pytest.mark.parametrize("timeout_s", [0, -1, 1e300])
def test_pause_refuses_a_timeout_out_of_range(fake, make_sidecar, timeout_s):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + "/agl/v1/pause", json={"drain": True, "timeout_s": timeout_s})
    assert response.status_code == 400 and "timeout_s" in response.json()["error"]


# --- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"policy_version": 2**63}, "policy_version"),
        ({"policy_version": -1}, "policy_version"),
        ({"sampling": {"train": {"max_tokens": 2**64}}}, "sampling.train.max_tokens"),
        ({"sampling": {"train": {"temperature": "hot"}}}, "sampling.train.temperature"),
        ({"sampling": {"val": {"n": 1.5}}}, "sampling.val.n"),
    ],
)
def test_configured_values_a_span_copies_are_checked_at_startup(settings, fragment):
    from agl_sidecar.config import ConfigError, build

    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        build({"upstream": ["http://127.0.0.1:1"], **settings})
