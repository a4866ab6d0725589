"""No open door: off loopback the sidecar wants an API key (or an explicit --no-api-key), and the
per-rollout keys it is given are enforced like --api-key."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from agl import semconv
from agl_sidecar.config import ConfigError, build

MESSAGES = [{"role": "user", "content": "go"}]


def _start(*flags: str) -> tuple[str, str, int | None]:
    """Start agl-sidecar with `flags`: (its first stdout line, its stderr, exit code or None if it runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_SIDECAR_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "agl_sidecar.cli", "--upstream", "http://127.0.0.1:9", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        first = process.stdout.readline()  # the ready line, or "" once it exits
        code = process.poll() if first else process.wait(30)
        err = "" if first else process.stderr.read()
        return first, err, code
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(10)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0"])
def test_off_loopback_without_a_key_refuses_to_start_naming_the_flags(listen, tmp_path):
    first, err, code = _start("--listen", listen, "--spool-dir", str(tmp_path))
    assert not first.startswith("agl-sidecar listening"), "an open proxy started"
    assert code == 2 and "Traceback" not in err
    assert "--api-key" in err and "--no-api-key" in err and "not loopback" in err


def test_off_loopback_with_a_key_or_the_explicit_opt_out_starts(tmp_path):
    for flags in (["--api-key", "k"], ["--no-api-key"]):
        first, _, code = _start("--listen", "0.0.0.0:0", "--spool-dir", str(tmp_path), *flags)
        assert first.startswith("agl-sidecar listening on http://") and code is None


def test_the_rule_holds_for_config_files_and_rollout_keys():
    with pytest.raises(ConfigError, match="not loopback"):
        build({"upstream": ["http://a"], "listen": "10.1.2.3:8400"})
    build({"upstream": ["http://a"], "listen": "10.1.2.3:8400", "rollout_api_keys": {"k": "r"}})
    build({"upstream": ["http://a"], "listen": "localhost:8400"})  # loopback by name


def test_per_rollout_keys_alone_are_enforced(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint, rollout_api_keys={"key-r9": "r9"})
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    url = sidecar.url + "/v1/chat/completions"
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer key-r8"}).status_code == 401
    reward = httpx.post(sidecar.url + "/rollouts/r9/reward", json={"value": 1.0})
    assert reward.status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer key-r9"}).status_code == 200
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.ROLLOUT_ID] == "r9" and len(fake.requests) == 1


def test_a_per_rollout_key_acts_for_its_own_rollout_only(fake, make_sidecar, otlp_sink):
    # Before: a key mapped to r9 posted calls and rewards to any rollout through the URL path.
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint,
                           rollout_api_keys={"key-r9": "r9", "key-r8": "r8"}, api_key="global-key")
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    r9 = {"Authorization": "Bearer key-r9"}
    refused = [
        httpx.post(sidecar.url + "/rollouts/r8/v1/chat/completions", json=body, headers=r9),
        httpx.post(sidecar.url + "/rollouts/r8/attempts/1/v1/completions", json={"model": "tiny", "prompt": "x"},
                   headers=r9),
        httpx.post(sidecar.url + "/v1/chat/completions", json=body, headers={**r9, "x-agl-rollout-id": "r8"}),
        httpx.post(sidecar.url + "/v1/chat/completions", json=body, headers={**r9, "baggage": "agl.rollout.id=r8"}),
        httpx.post(sidecar.url + "/rollouts/r8/reward", json={"value": 1.0}, headers=r9),
        httpx.post(sidecar.url + "/rollouts/r8/end", json={}, headers={"x-api-key": "key-r9"}),
        httpx.get(sidecar.url + "/rollouts/r8/v1/models", headers=r9),
        httpx.post(sidecar.url + "/rollouts/r8/v1/messages", headers={"x-api-key": "key-r9"},
                   json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "go"}]},
                   timeout=120),  # the first translated call loads litellm
    ]
    for answer in refused:
        assert answer.status_code == 403, (answer.request.url, answer.text)
        assert "r9" in answer.text and "r8" in answer.text, answer.text
    assert fake.requests == []
    # Its own rollout, named or not; the global key, any rollout.
    assert httpx.post(sidecar.url + "/rollouts/r9/v1/chat/completions", json=body, headers=r9).status_code == 200
    assert httpx.post(sidecar.url + "/v1/chat/completions", json=body, headers={**r9, "x-agl-rollout-id": "r9"}).status_code == 200
    assert httpx.post(sidecar.url + "/rollouts/r9/reward", json={"value": 1.0}, headers=r9).status_code == 200
    glob = {"Authorization": "Bearer global-key"}
    assert httpx.post(sidecar.url + "/rollouts/r8/v1/chat/completions", json=body, headers=glob).status_code == 200
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 4)
    assert sorted(s.attributes[semconv.ROLLOUT_ID] for s in spans) == ["r8", "r9", "r9", "r9"]
