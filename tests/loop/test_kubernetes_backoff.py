"""The Kubernetes runner while the API server is away or shedding load (429, 5xx): bounded exponential
backoff with jitter, Retry-After honored, a clear cause once the tries are spent, and the config a
pod's service account gives (in-cluster), against the stand-in API server (tests/support/fake_kube.py)."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from agl_trainer.run.build import build_kubernetes_runner
from agl_trainer.runners.base import Cause, Endpoint, RolloutSpec
from agl_trainer.runners.kubernetes import KubernetesRunner, load_api_client
from agl_trainer.runners.kubernetes_manifest import JobTemplate
from agl_trainer.runners.kubernetes_retry import ApiUnavailable, Backoff, call_with_backoff
from tests.support.fake_kube import FakeKube
from tests.support.tls import self_signed
from tests.support.waiting import wait_until_async

SIDECAR = "http://agl-sidecar.train.svc:8400"
FAST = Backoff(attempts=4, base_s=0.01, max_s=2.0)


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()


def _runner(fake: FakeKube, tmp_path: Path, **options: Any) -> KubernetesRunner:
    options.setdefault("backoff", FAST)
    options.setdefault("reconcile_s", 30.0)
    kubeconfig = str(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    return KubernetesRunner(JobTemplate(image="img:1", command=["run"]), Endpoint(SIDECAR), kubeconfig=kubeconfig, **options)


def _spec(rollout_id: str, scenario: str = "succeed") -> RolloutSpec:
    return RolloutSpec(rollout_id, "task", {"id": "task", "scenario": scenario})


def test_the_wait_grows_jittered_is_bounded_and_honors_retry_after() -> None:
    backoff, rng = Backoff(attempts=8, base_s=0.5, max_s=4.0), random.Random(0)
    for retry in range(8):
        waits = [backoff.delay(retry, rng=rng) for _ in range(200)]
        cap = min(4.0, 0.5 * 2**retry)
        assert all(0 <= w <= cap for w in waits) and max(waits) > cap * 0.9 and len(set(waits)) > 100  # spread
    assert all(backoff.delay(0, 3.0, rng) >= 3.0 for _ in range(50))  # Retry-After: at least that long
    assert backoff.delay(0, 600.0, rng) == 4.0  # ... but no longer than max_s
    with pytest.raises(ValueError):
        Backoff(attempts=0)


async def test_only_transient_failures_are_tried_again() -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    answers: list[BaseException | str] = [ApiException(503, "Service Unavailable"), ConnectionRefusedError(111, "refused"), "ok"]

    async def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert await call_with_backoff(call, FAST, "https://k8s", sleep=sleep) == "ok" and len(waits) == 2
    answers[:] = [ApiException(403, "Forbidden"), "ok"]
    with pytest.raises(ApiException) as refused:  # an answer, not an outage: at once
        await call_with_backoff(call, FAST, "https://k8s", sleep=sleep)
    assert refused.value.status == 403 and len(waits) == 2
    answers[:] = [ApiException(500, "Internal Server Error")] * 4 + ["ok"]
    with pytest.raises(ApiUnavailable, match=r"the Kubernetes API server at https://k8s answered 500 Internal Server Error, 4 tries"):
        await call_with_backoff(call, FAST, "https://k8s", sleep=sleep)
    assert answers == ["ok"]  # exactly `attempts` tries


async def test_a_create_answered_5xx_429_or_nothing_is_tried_again_and_the_rollout_runs(
    fake: FakeKube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _runner(fake, tmp_path, retries=0)
    await runner.start()
    try:
        fake.fail(2, 503, method="POST")
        unavailable = await runner.run(_spec("r-503"))
        fake.fail(1, 0, method="POST")  # the connection closes unanswered
        dropped = await runner.run(_spec("r-dropped"))
        fake.fail(1, 429, retry_after="1", method="POST")
        with caplog.at_level(logging.WARNING, logger="agl_trainer.runners.kubernetes"):
            throttled = await runner.run(_spec("r-429"))
    finally:
        await runner.stop()
    assert [o.cause for o in (unavailable, dropped, throttled)] == [Cause.OK] * 3
    assert [(m, s) for m, _, s in fake.failed] == [("POST", 503), ("POST", 503), ("POST", 0), ("POST", 429)]
    assert len(fake.jobs()) == 3  # one Job each
    waits = [float(w) for w in re.findall(r"429 Too Many Requests.*trying again in ([\d.]+) s", caplog.text)]
    assert waits and waits[0] >= 1.0, caplog.text  # Retry-After: 1 honored


async def test_an_api_server_that_stays_away_fails_the_rollout_with_its_address_and_status(
    fake: FakeKube, tmp_path: Path
) -> None:
    runner = _runner(fake, tmp_path, retries=1)
    await runner.start()
    try:
        fake.fail(8, 503, method="POST")  # 4 tries for each of the 2 attempts
        failed = await runner.run(_spec("r-away"))
        after = await runner.run(_spec("r-back"))  # the loop goes on: the next rollout runs
    finally:
        await runner.stop()
    assert failed.cause is Cause.INFRA_ERROR and failed.attempts == 2
    assert f"the Kubernetes API server at {fake.url} answered 503 Service Unavailable" in failed.message
    assert "4 tries" in failed.message and "could not create job" in failed.message
    assert after.cause is Cause.OK


async def test_lists_and_deletes_ride_out_an_outage(fake: FakeKube, tmp_path: Path) -> None:
    fake.fail(3, 503, method="GET", path="/jobs")  # the first list at start
    runner = _runner(fake, tmp_path, start_timeout_s=3600.0)
    await runner.start()
    try:
        run = asyncio.create_task(runner.run(_spec("r-cancel", "hold")))
        await wait_until_async(lambda: any(j["status"].get("ready") for j in fake.jobs().values()), "the job to run")
        fake.fail(2, 502, method="DELETE")
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    finally:
        await runner.stop()
    assert fake.jobs() == {}  # deleted after two 502s
    assert [s for m, _, s in fake.failed] == [503, 503, 503, 502, 502]


def test_the_tries_and_the_longest_wait_come_from_the_config(tmp_path: Path) -> None:
    from agl_trainer.config import ConfigError, load_config

    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a"}\n')
    args = [f"--tasks={tasks}", f"--model.path={tmp_path}", "--harness.runner=kubernetes", "--harness.image=img:1",
            f"--harness.kubernetes.sidecar_url={SIDECAR}"]  # fmt: skip
    config = load_config(None, [*args, "--harness.kubernetes.api_tries=3", "--harness.kubernetes.api_backoff_max_s=5"])
    runner = build_kubernetes_runner(config, Endpoint(SIDECAR))
    assert (runner.backoff.attempts, runner.backoff.max_s) == (3, 5.0)
    assert build_kubernetes_runner(load_config(None, args), Endpoint(SIDECAR)).backoff == Backoff()
    with pytest.raises(ConfigError, match="harness.kubernetes.api_tries"):
        load_config(None, [*args, "--harness.kubernetes.api_tries=0"])


async def test_start_names_the_server_and_status_once_the_tries_are_spent(fake: FakeKube, tmp_path: Path) -> None:
    fake.fail(100, 503, method="GET")
    runner = _runner(fake, tmp_path)
    with pytest.raises(RuntimeError, match=rf"cannot list Jobs in namespace default: the Kubernetes API server at "
                                           rf"{re.escape(fake.url)} answered 503 Service Unavailable.*4 tries.*fix: "):  # fmt: skip
        await runner.start()
    await runner.stop()


# --- in a pod: the service account's token and CA, KUBERNETES_SERVICE_HOST ---------------------------


async def test_in_a_pod_the_service_account_reaches_the_api_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.config import incluster_config

    account = tmp_path / "serviceaccount"  # what the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount
    account.mkdir()
    cert, key = self_signed(account, "kubernetes")
    (account / "token").write_text("sa-token-123")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = FakeKube(ssl_context=tls).start()
    try:
        port = server.url.rsplit(":", 1)[1]
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
        # The client reads these two paths; the test points them at its folder (no real pod here).
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(account / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cert))
        client = load_api_client(None, None)
        assert client.configuration.host == f"https://127.0.0.1:{port}"
        runner = KubernetesRunner(JobTemplate(image="img:1", command=["run"]), Endpoint(SIDECAR), api_client=client,
                                  backoff=FAST, reconcile_s=30.0)  # fmt: skip
        await runner.start()
        try:
            outcome = await runner.run(_spec("r-in-cluster"))
        finally:
            await runner.stop()
        assert outcome.cause is Cause.OK
        # every request carried the account's token (the client spells the scheme "bearer": case-insensitive)
        assert {a.lower() for a in server.authorizations} == {"bearer sa-token-123"}
        # A kubeconfig, when given, wins over the pod's account.
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        assert load_api_client(str(kubeconfig), None).configuration.auth_settings()["BearerToken"]["value"] == "Bearer fake-token"
        (account / "token").unlink()  # no token mounted: a clear error naming the key and the fix
        with pytest.raises(RuntimeError, match="harness.kubernetes.kubeconfig: .*Service token file does not exist.*fix: "):
            load_api_client(None, None)
    finally:
        server.stop()
