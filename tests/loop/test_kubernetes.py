"""Kubernetes Job manifests per rollout (no cluster here: the manifest and the status mapping)."""

from __future__ import annotations

import json

from agl_trainer.runners.base import Cause, Endpoint, RolloutSpec
from agl_trainer.runners.kubernetes import build_job_manifest, classify_job, job_name


def test_job_manifest_carries_the_rollout_environment() -> None:
    spec = RolloutSpec("Run_1/g0-3", "task-9", {"id": "task-9", "q": "2+2"}, attempt=1)
    endpoint = Endpoint("http://agl-sidecar.train.svc:8400", "http://agl-trainer.train.svc:4318")
    manifest = build_job_manifest(
        spec, endpoint, image="ghcr.io/me/harness:1", command=["python", "run.py"], namespace="train", timeout_s=90.5
    )
    assert manifest["kind"] == "Job" and manifest["apiVersion"] == "batch/v1"
    assert manifest["metadata"]["name"] == "agl-run-1-g0-3-a1" == job_name(spec)
    assert manifest["metadata"]["namespace"] == "train"
    job = manifest["spec"]
    assert job["backoffLimit"] == 0  # retries are the runner's, for infrastructure failures only
    assert job["activeDeadlineSeconds"] == 90
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/me/harness:1" and container["command"] == ["python", "run.py"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["OPENAI_BASE_URL"] == "http://agl-sidecar.train.svc:8400/rollouts/Run_1/g0-3/attempts/1/v1"
    assert env["AGL_ROLLOUT_ID"] == "Run_1/g0-3" and env["AGL_ATTEMPT"] == "1" and env["AGL_TASK_ID"] == "task-9"
    assert json.loads(env["AGL_TASK"]) == {"id": "task-9", "q": "2+2"}
    assert env["AGL_OTLP_ENDPOINT"] == "http://agl-trainer.train.svc:4318"
    json.dumps(manifest)  # what kubectl apply -f - receives


def test_long_rollout_ids_make_valid_job_names() -> None:
    name = job_name(RolloutSpec("x" * 200, "t", {}, attempt=12))
    assert len(name) <= 63 and name.endswith("-a12")


def test_job_status_maps_to_outcome_causes() -> None:
    assert classify_job({"active": 1}) is None
    assert classify_job({"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}) is Cause.OK
    failed = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}
    assert classify_job({"conditions": [failed], "failed": 1}) is Cause.HARNESS_ERROR
    deadline = {"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}
    assert classify_job({"conditions": [deadline]}) is Cause.TIMEOUT
    evicted = {"type": "Failed", "status": "True", "reason": "PodEvicted"}
    assert classify_job({"conditions": [evicted]}) is Cause.INFRA_ERROR
