"""The Kubernetes runner: Job manifests from the config, checked against the client's OpenAPI models,
and rollouts run as Jobs through the official client against a stand-in API server over loopback
(tests/support/fake_kube.py: batch/v1 Jobs, core/v1 Pods with watch, Events)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.config import ConfigError, load_config
from agl_trainer.run.build import build_kubernetes_runner
from agl_trainer.runners.base import Cause, Endpoint, RolloutOutcome, RolloutSpec
from agl_trainer.runners.kubernetes import KubernetesRunner, build_job_manifest, classify_job, job_name, plain_secrets
from agl_trainer.runners.kubernetes_manifest import (
    LABEL_ATTEMPT,
    LABEL_ROLLOUT,
    LABEL_RUNNER,
    JobTemplate,
    ManifestError,
    check_job_manifest,
    check_object,
)
from agl_trainer.runners.kubernetes_retry import Backoff
from agl_trainer.runners.kubernetes_status import job_verdict
from agl_trainer.runners.ratelimit import RateLimiter
from tests.support.fake_kube import FakeKube
from tests.support.waiting import wait_until_async

SIDECAR = "http://agl-sidecar.train.svc:8400"
TEMPLATE = JobTemplate(
    image="ghcr.io/me/harness:1",
    command=["python", "run.py"],
    namespace="train",
    timeout_s=90.5,
    ttl_s=120,
    service_account="harness-runner",
    resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi", "nvidia.com/gpu": "1"}},
    node_selector={"pool": "agents"},
    tolerations=[{"key": "dedicated", "operator": "Equal", "value": "agents", "effect": "NoSchedule"}],
    env_from_secrets=["tool-keys"],
    secret_env={"OPENAI_API_KEY": "harness-keys/sidecar"},
    image_pull_secrets=["registry"],
    labels={"team": "rl"},
)


# --- manifests -----------------------------------------------------------------------------------


def test_job_manifest_from_the_template_carries_the_rollout_environment() -> None:
    spec = RolloutSpec("Run_1/g0-3", "task-9", {"id": "task-9", "q": "2+2"}, attempt=1)
    endpoint = Endpoint(SIDECAR, "http://agl-trainer.train.svc:4318")
    manifest = build_job_manifest(spec, endpoint, TEMPLATE, runner_id="abc123")
    check_job_manifest(manifest)  # what the API server's schema accepts
    assert manifest["kind"] == "Job" and manifest["apiVersion"] == "batch/v1"
    assert manifest["metadata"]["name"] == "agl-run-1-g0-3-abc123-a1" == job_name(spec, "abc123")
    assert manifest["metadata"]["namespace"] == "train"
    labels = manifest["metadata"]["labels"]
    assert labels[LABEL_ROLLOUT] == "Run_1-g0-3" and labels[LABEL_ATTEMPT] == "1" and labels[LABEL_RUNNER] == "abc123"
    assert labels["team"] == "rl" and manifest["metadata"]["annotations"][LABEL_ROLLOUT] == "Run_1/g0-3"
    job = manifest["spec"]
    assert job["backoffLimit"] == 0  # retries are the runner's, for infrastructure failures only
    assert job["activeDeadlineSeconds"] == 90 and job["ttlSecondsAfterFinished"] == 120
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "harness-runner"
    assert pod["nodeSelector"] == {"pool": "agents"} and pod["tolerations"][0]["effect"] == "NoSchedule"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert job["template"]["metadata"]["labels"][LABEL_RUNNER] == "abc123"  # the pod watch selects on it
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/me/harness:1" and container["command"] == ["python", "run.py"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["envFrom"] == [{"secretRef": {"name": "tool-keys"}}]
    env = {item["name"]: item for item in container["env"]}
    assert env["OPENAI_BASE_URL"]["value"] == f"{SIDECAR}/rollouts/Run_1%2Fg0-3/attempts/1/v1"  # one path segment
    assert env["AGL_ROLLOUT_ID"]["value"] == "Run_1/g0-3" and env["AGL_ATTEMPT"]["value"] == "1"
    assert env["AGL_TASK_ID"]["value"] == "task-9" and env["AGL_ROLLOUT_MODE"]["value"] == "train"
    assert json.loads(env["AGL_TASK"]["value"]) == {"id": "task-9", "q": "2+2"}
    assert env["AGL_OTLP_ENDPOINT"]["value"] == "http://agl-trainer.train.svc:4318"
    # the secret's value replaces the placeholder key: one OPENAI_API_KEY, from the secret
    assert [item["name"] for item in container["env"]].count("OPENAI_API_KEY") == 1
    assert env["OPENAI_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "harness-keys", "key": "sidecar"}}


def test_long_rollout_ids_make_valid_distinct_job_names() -> None:
    a = job_name(RolloutSpec("x" * 200 + "a", "t", {}, attempt=12), "abc123")
    b = job_name(RolloutSpec("x" * 200 + "b", "t", {}, attempt=12), "abc123")
    assert len(a) <= 63 and a.endswith("-abc123-a12") and a != b


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always"),
         "spec.template.spec.containers.0.imagePullPolicyy: unknown field of V1Container"),
        (lambda m: m["spec"].update(backoffLimit="0"), "spec.backoffLimit: expected an integer, got '0'"),
        (lambda m: m["spec"]["template"]["spec"]["containers"][0].pop("name"), "`name`, must not be `None`"),
        (lambda m: m["spec"]["template"]["spec"].update(tolerations={"key": "x"}),
         "spec.template.spec.tolerations: expected a list"),
        (lambda m: m["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update(memory="2 GB"),
         "resources.limits.memory: '2 GB' is not a Kubernetes quantity"),
        (lambda m: m["metadata"]["labels"].update(team="not ok!"), "metadata.labels.team"),
    ],
)  # fmt: skip
def test_manifest_check_names_what_the_api_server_would_reject(change: Any, message: str) -> None:
    manifest = build_job_manifest(RolloutSpec("r", "t", {}), Endpoint(SIDECAR), TEMPLATE)
    check_job_manifest(copy.deepcopy(manifest))
    change(manifest)
    with pytest.raises(ManifestError) as error:
        check_job_manifest(manifest)
    assert message in str(error.value)


def test_check_object_reads_the_clients_models() -> None:
    check_object({"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}, "V1Toleration")
    with pytest.raises(ManifestError, match="efect: unknown field of V1Toleration .*effect"):
        check_object({"key": "gpu", "efect": "NoSchedule"}, "V1Toleration")


def test_job_status_maps_to_outcome_causes() -> None:
    assert classify_job({"active": 1}) is None
    assert classify_job({"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}) is Cause.OK
    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
    assert classify_job({"conditions": [failed], "failed": 1}) is Cause.HARNESS_ERROR
    deadline = {"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}
    assert classify_job({"conditions": [deadline]}) is Cause.TIMEOUT
    evicted = {"type": "Failed", "status": "True", "reason": "PodEvicted"}
    assert classify_job({"conditions": [evicted]}) is Cause.INFRA_ERROR
    job = {"metadata": {"name": "j"}, "status": {"conditions": [failed], "failed": 1}}
    pod = {"status": {"phase": "Failed", "containerStatuses": [{"name": "harness", "state": {"terminated": {"exitCode": 75}}}]}}
    verdict = job_verdict(job, [pod])
    assert verdict is not None and verdict.cause is Cause.INFRA_ERROR and verdict.exit_code == 75  # "retry me"


async def test_rate_limiter_spaces_acquisitions() -> None:
    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limiter = RateLimiter(4.0, burst=2, clock=lambda: now[0], sleep=sleep)
    for _ in range(4):
        await limiter.acquire()
    assert slept == [0.25, 0.25]  # the burst of two goes at once, then one every 1/rate seconds
    now[0] += 10.0  # idle: the bucket refills to the burst, not beyond
    for _ in range(3):
        await limiter.acquire()
    assert slept == [0.25, 0.25, 0.25]


# --- config --------------------------------------------------------------------------------------


def _config_args(tmp_path: Path) -> list[str]:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a"}\n')
    return [f"--tasks={tasks}", f"--model.path={tmp_path}", "--harness.runner=kubernetes", "--harness.image=img:1"]


def test_kubernetes_config_is_checked_with_keys_and_fixes(tmp_path: Path) -> None:
    base = [*_config_args(tmp_path), f"--harness.kubernetes.sidecar_url={SIDECAR}"]
    config = load_config(None, [*base, "--harness.command=/opt/harness/run --fast"])  # a path in the image
    assert config.harness.kubernetes.ttl_s == 600 and config.harness.kubernetes.create_rate == 5.0
    cases = {
        "--harness.function=examples.demo.harness:run_episode": "config key harness.function: .*runs a command "
        "in a container \\(fix: set harness.command",
        "--harness.grader=grade.sh": "config key harness.grader: .*agl.emit_reward",
        "--harness.kubernetes.resources={limits: {memory: 2 GB}}": "harness.kubernetes.resources.limits.memory: "
        "'2 GB' is not a Kubernetes quantity",
        "--harness.kubernetes.resources={limit: {memory: 2Gi}}": "harness.kubernetes.resources.limit: unknown",
        "--harness.kubernetes.tolerations=[{key: gpu, efect: NoSchedule}]": "harness.kubernetes.tolerations.0: "
        "efect: unknown field of V1Toleration",
        "--harness.kubernetes.secret_env={OPENAI_API_KEY: just-a-secret}": "harness.kubernetes.secret_env."
        "OPENAI_API_KEY: 'just-a-secret' is not secret-name/key",
        "--harness.kubernetes.sidecar_url=http://127.0.0.1:8400": "harness.kubernetes.sidecar_url: .*loopback",
        "--harness.kubernetes.create_rate=0": "harness.kubernetes.create_rate: expected float > 0",
        "--harness.kubernetes.node_selector={pool: not ok!}": "harness.kubernetes.node_selector.pool",
    }
    for flag, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, "--harness.command=run", flag])
    with pytest.raises(ConfigError, match="harness.kubernetes.sidecar_url: pods need the sidecar's address .*fix: "):
        load_config(None, [*_config_args(tmp_path), "--harness.command=run"])
    advertised = load_config(None, [*_config_args(tmp_path), "--sidecar.advertise_url=http://10.0.0.5:8400"])
    runner = build_kubernetes_runner(advertised, Endpoint("http://127.0.0.1:1234", "http://127.0.0.1:4318"))
    assert runner.endpoint.sidecar_url == "http://10.0.0.5:8400"  # what pods reach, not this machine's loopback
    assert runner.endpoint.otlp_endpoint is None and runner.template.command is None  # the image's entrypoint


# --- against the stand-in API server -------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    server = FakeKube().start()
    yield server
    server.stop()
    for manifest in server.created:  # every Job the runner sent passes the schema check
        check_job_manifest(manifest)


def _runner(fake: FakeKube, tmp_path: Path, template: JobTemplate | None = None, **options: Any) -> KubernetesRunner:
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    template = template or JobTemplate(image="img:1", command=["python", "run.py"])
    options.setdefault("reconcile_s", 30.0)  # long: a test that needs the periodic list sets it short
    options.setdefault("start_timeout_s", 0.3)
    options.setdefault("log_dir", tmp_path / "rollouts")
    return KubernetesRunner(template, Endpoint(SIDECAR), kubeconfig=str(kubeconfig), **options)


def _spec(rollout_id: str, scenario: str = "succeed") -> RolloutSpec:
    return RolloutSpec(rollout_id, "task", {"id": "task", "scenario": scenario})


async def test_a_rollout_runs_as_a_job_and_reports_its_exit(fake: FakeKube, tmp_path: Path) -> None:
    exits: list[RolloutOutcome] = []
    runner = _runner(fake, tmp_path, retries=0, on_exit=exits.append)
    await runner.start()
    try:
        ok, failed = await asyncio.gather(runner.run(_spec("r-ok")), runner.run(_spec("r-bad", "fail:3")))
    finally:
        await runner.stop()
    assert ok.cause is Cause.OK and ok.exit_code == 0
    assert failed.cause is Cause.HARNESS_ERROR and failed.exit_code == 3 and "harness exited 3" in failed.message
    assert "kubectl logs -n default job/" in failed.message
    assert ok.log_path is None and failed.log_path is not None  # the failed pod's log, kept past the Job's TTL
    assert Path(failed.log_path).read_text().endswith('{"step": 1}\nTraceback (most recent call last):\nValueError: bad task\n')
    assert sorted(o.spec.rollout_id for o in exits) == ["r-bad", "r-ok"]
    sent = {m["metadata"]["name"]: m for m in fake.created}
    env = {e["name"]: e.get("value") for e in sent[job_name(ok.spec, runner.runner_id)]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"] == f"{SIDECAR}/rollouts/r-ok/v1"
    assert fake.watch_requests >= 2  # learned from the watches (Jobs and Pods), not by polling


@pytest.mark.parametrize(
    ("scenario", "reason"),
    [
        ("image_pull", "ImagePullBackOff: Back-off pulling image \"img:1\""),
        ("invalid_image", "InvalidImageName"),
        ("unschedulable", "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu"),
        ("no_pod", "no pod was created: FailedCreate: Error creating: pods .* exceeded quota"),
    ],
)
async def test_a_job_that_never_starts_is_reported_with_its_reason(
    fake: FakeKube, tmp_path: Path, scenario: str, reason: str
) -> None:
    runner = _runner(fake, tmp_path, retries=1)
    await runner.start()
    try:
        outcome = await runner.run(_spec("r", scenario))
    finally:
        await runner.stop()
    assert outcome.cause is Cause.INFRA_ERROR and outcome.attempts == 2  # retried once, as the next attempt
    assert "never started" in outcome.message
    assert __import__("re").search(reason, outcome.message), outcome.message
    assert fake.jobs() == {}  # a Job that cannot start is deleted, not left pending


async def test_a_missing_secret_fails_the_attempt_at_once(fake: FakeKube, tmp_path: Path) -> None:
    template = JobTemplate(image="img:1", command=["run"], secret_env={"OPENAI_API_KEY": "harness-keys/sidecar"})
    runner = _runner(fake, tmp_path, template, retries=0, start_timeout_s=3600.0)  # no waiting it out
    await runner.start()
    try:
        outcome = await runner.run(_spec("r", "hold"))
    finally:
        await runner.stop()
    assert outcome.cause is Cause.INFRA_ERROR
    assert 'never started: pod agl-r-' in outcome.message and 'CreateContainerConfigError: secret "harness-keys" not found' in outcome.message


def test_keys_in_plain_pod_env_are_named() -> None:
    endpoint = Endpoint(SIDECAR, extra_env={"OPENAI_API_KEY": "k", "AGL_OTLP_HEADERS": "authorization=Bearer t"})
    assert plain_secrets(endpoint, JobTemplate(image="i")) == ["OPENAI_API_KEY", "AGL_OTLP_HEADERS"]
    in_secrets = JobTemplate(image="i", secret_env={"OPENAI_API_KEY": "s/k", "AGL_OTLP_HEADERS": "s/h"})
    assert plain_secrets(endpoint, in_secrets) == [] and plain_secrets(Endpoint(SIDECAR), JobTemplate(image="i")) == []


async def test_retry_me_exit_and_eviction_are_retried_as_new_attempts(fake: FakeKube, tmp_path: Path) -> None:
    runner = _runner(fake, tmp_path, retries=2)
    await runner.start()
    try:
        retry, evicted, oom = await asyncio.gather(
            runner.run(_spec("r75", "fail:75")), runner.run(_spec("ev", "evict")), runner.run(_spec("oom", "oom"))
        )
    finally:
        await runner.stop()
    assert retry.cause is Cause.INFRA_ERROR and retry.attempts == 3 and retry.exit_code == 75
    names = {m["metadata"]["name"] for m in fake.created}
    assert {job_name(RolloutSpec("r75", "t", {}, attempt=a), runner.runner_id) for a in range(3)} <= names
    assert evicted.cause is Cause.INFRA_ERROR and "Evicted" in evicted.message
    assert oom.cause is Cause.HARNESS_ERROR and oom.attempts == 1 and "resources.limits.memory" in oom.message


async def test_concurrency_limits_jobs_in_flight(fake: FakeKube, tmp_path: Path) -> None:
    runner = _runner(fake, tmp_path, concurrency=2, create_rate=50.0)
    await runner.start()
    try:
        runs = [asyncio.create_task(runner.run(_spec(f"r{i}", "hold"))) for i in range(5)]
        finished: set[str] = set()
        while len(finished) < 5:
            await wait_until_async(
                lambda: sum(1 for n, j in fake.jobs().items() if n not in finished and j["status"].get("ready")) == min(2, 5 - len(finished)),
                "the held jobs to run",
            )
            assert fake.live_jobs() <= 2
            for name, job in fake.jobs().items():
                if name not in finished and job["status"].get("ready"):
                    fake.finish(name)
                    finished.add(name)
        outcomes = await asyncio.gather(*runs)
    finally:
        await runner.stop()
    assert all(o.cause is Cause.OK for o in outcomes)
    assert fake.max_live == 2 and len(fake.created) == 5


async def test_a_missed_watch_event_is_found_by_the_periodic_list(fake: FakeKube, tmp_path: Path) -> None:
    runner = _runner(fake, tmp_path, reconcile_s=0.2)
    await runner.start()
    try:
        run = asyncio.create_task(runner.run(_spec("r", "hold")))
        await wait_until_async(lambda: any(j["status"].get("ready") for j in fake.jobs().values()), "the job to run")
        lists_before = fake.list_requests
        (name,) = fake.jobs()
        with fake.silently():  # the pod ends and the Job completes; no watch hears of it
            fake.finish(name)
        outcome = await asyncio.wait_for(run, 20)
    finally:
        await runner.stop()
    assert outcome.cause is Cause.OK
    assert fake.list_requests > lists_before


async def test_a_watch_expired_with_410_gone_resumes_from_a_fresh_list(fake: FakeKube, tmp_path: Path) -> None:
    runner = _runner(fake, tmp_path, reconcile_s=3600.0)  # only the watches' own relist can help
    await runner.start()
    try:
        run = asyncio.create_task(runner.run(_spec("r", "hold")))
        await wait_until_async(lambda: any(j["status"].get("ready") for j in fake.jobs().values()), "the job to run")
        (name,) = fake.jobs()
        with fake.silently():
            fake.finish(name)  # happens while the watches are away ...
        fake.compact()  # ... and the history they would resume from is gone
        fake.drop_watches()
        outcome = await asyncio.wait_for(run, 20)
    finally:
        await runner.stop()
    assert outcome.cause is Cause.OK
    assert runner.tracker is not None and runner.tracker.reconciles >= 1


async def test_cancel_and_stop_delete_the_jobs(fake: FakeKube, tmp_path: Path) -> None:
    runner = _runner(fake, tmp_path)
    await runner.start()
    cancelled = asyncio.create_task(runner.run(_spec("cancel-me", "hold")))
    kept = asyncio.create_task(runner.run(_spec("at-stop", "hold")))
    await wait_until_async(lambda: sum(1 for j in fake.jobs().values() if j["status"].get("ready")) == 2, "two jobs")
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert [n for n in fake.jobs() if "cancel-me" in n] == [] and any("cancel-me" in n for n in fake.deleted)
    await runner.stop()
    assert fake.jobs() == {} and fake.pods() == {}  # Background propagation took the pods too
    outcome = await asyncio.wait_for(kept, 10)
    assert outcome.cause is Cause.CANCELLED


async def test_a_job_deleted_from_outside_or_refused_by_quota_is_an_infra_error(fake: FakeKube, tmp_path: Path) -> None:
    runner = _runner(fake, tmp_path, retries=0)
    await runner.start()
    try:
        run = asyncio.create_task(runner.run(_spec("r", "hold")))
        await wait_until_async(lambda: any(j["status"].get("ready") for j in fake.jobs().values()), "the job to run")
        (name,) = fake.jobs()
        fake.call(fake._remove, "jobs", "default", name)  # kubectl delete job
        deleted = await asyncio.wait_for(run, 20)
        fake.job_quota = 0
        refused = await runner.run(_spec("q"))
    finally:
        await runner.stop()
    assert deleted.cause is Cause.INFRA_ERROR and "deleted before it finished" in deleted.message
    assert refused.cause is Cause.INFRA_ERROR and "403 Forbidden" in refused.message and "exceeded quota" in refused.message


async def test_start_says_what_to_fix_when_the_cluster_is_unreachable(tmp_path: Path) -> None:
    server = FakeKube().start()
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    server.stop()  # nothing listens there any more
    runner = KubernetesRunner(JobTemplate(image="img:1"), Endpoint(SIDECAR), kubeconfig=str(kubeconfig),
                              backoff=Backoff(attempts=2, base_s=0.01))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"cannot list Jobs in namespace default: the Kubernetes API server at "
                                           r"http://127\.0\.0\.1:\d+ did not answer .*2 tries.*fix: "):  # fmt: skip
        await runner.start()
    await runner.stop()
    missing = KubernetesRunner(JobTemplate(image="img:1"), Endpoint(SIDECAR), kubeconfig=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="config key harness.kubernetes.kubeconfig: cannot load"):
        await missing.start()
    loopback = KubernetesRunner(JobTemplate(image="img:1"), Endpoint("http://127.0.0.1:8400"), kubeconfig=str(kubeconfig))
    with pytest.raises(RuntimeError, match="loopback .*sidecar.advertise_url"):
        await loopback.start()


async def test_a_job_already_there_is_adopted_when_it_is_this_runners(fake: FakeKube, tmp_path: Path) -> None:
    """A create whose response was lost (and retried) finds its own Job: 409 AlreadyExists is adopted."""
    runner = _runner(fake, tmp_path, retries=0)
    await runner.start()
    try:
        ours, theirs = _spec("ours"), _spec("theirs")
        fake.call(fake._create, "default", build_job_manifest(ours, runner.endpoint, runner.template, runner_id=runner.runner_id))
        foreign = build_job_manifest(theirs, runner.endpoint, runner.template, runner_id=runner.runner_id)
        foreign["metadata"]["labels"][LABEL_RUNNER] = "other"
        fake.call(fake._create, "default", foreign)
        adopted, refused = await asyncio.gather(runner.run(ours), runner.run(theirs))
    finally:
        await runner.stop()
    assert adopted.cause is Cause.OK
    assert refused.cause is Cause.INFRA_ERROR and "exists and is not this runner's" in refused.message
