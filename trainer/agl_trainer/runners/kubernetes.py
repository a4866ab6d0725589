"""Run the harness once per rollout as a Kubernetes Job, for more rollouts than one machine holds.

Each rollout is a Job (backoffLimit 0: retries are the runner's, for infrastructure failures only)
whose container gets the same environment as a local harness process (runners.base.Endpoint), so
the sidecar and OTLP endpoint must be reachable from the pods (give their in-cluster URLs).
`activeDeadlineSeconds` enforces the timeout and `ttlSecondsAfterFinished` cleans up. Jobs are
submitted and watched with `kubectl` (apply, get -o json), so whatever context kubectl uses applies;
no cluster client library is needed.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from typing import Any

from agl_trainer.runners.base import (
    Cause,
    Endpoint,
    ExitHook,
    RolloutOutcome,
    RolloutSpec,
    call_hook,
    run_with_retries,
)

POLL_S = 2.0
LABEL = "agl.dev/rollout-id"


def job_name(spec: RolloutSpec) -> str:
    """A DNS-1123 name (<= 63 chars) unique per rollout attempt."""
    base = re.sub(r"[^a-z0-9-]", "-", spec.rollout_id.lower()).strip("-")[:50] or "rollout"
    return f"agl-{base}-a{spec.attempt}"


def build_job_manifest(
    spec: RolloutSpec,
    endpoint: Endpoint,
    *,
    image: str,
    command: list[str] | None,
    namespace: str = "default",
    timeout_s: float = 300.0,
    resources: dict[str, Any] | None = None,
    service_account: str | None = None,
) -> dict[str, Any]:
    env = [{"name": key, "value": value} for key, value in sorted(endpoint.environment(spec).items())]
    container: dict[str, Any] = {"name": "harness", "image": image, "env": env}
    if command:
        container["command"] = list(command)
    if resources:
        container["resources"] = resources
    labels = {LABEL: re.sub(r"[^A-Za-z0-9._-]", "-", spec.rollout_id)[:63], "app.kubernetes.io/managed-by": "agl"}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(spec), "namespace": namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": max(1, int(timeout_s)),
            "ttlSecondsAfterFinished": 600,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def classify_job(status: dict[str, Any]) -> Cause | None:
    """None while running; how the Job ended otherwise."""
    for condition in status.get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            return Cause.OK
        if condition.get("type") == "Failed":
            reason = condition.get("reason", "")
            if reason == "DeadlineExceeded":
                return Cause.TIMEOUT
            if reason in ("PodFailurePolicy", "BackoffLimitExceeded") and status.get("failed"):
                return Cause.HARNESS_ERROR
            return Cause.INFRA_ERROR  # evicted, preempted, node lost
    return None


class KubernetesRunner:
    def __init__(
        self,
        command: list[str] | None,
        endpoint: Endpoint,
        *,
        image: str,
        namespace: str = "default",
        concurrency: int = 64,
        timeout_s: float = 300.0,
        retries: int = 2,
        on_exit: ExitHook | None = None,
    ) -> None:
        self.command = command
        self.endpoint = endpoint
        self.image = image
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.retries = retries
        self.on_exit = on_exit
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        if shutil.which("kubectl") is None:
            raise RuntimeError("the kubernetes runner needs `kubectl` on PATH (configured for the cluster)")

    async def stop(self) -> None:
        pass

    async def run(self, spec: RolloutSpec) -> RolloutOutcome:
        async with self._slots:
            return await run_with_retries(self._attempt, spec, self.retries)

    async def _attempt(self, spec: RolloutSpec) -> RolloutOutcome:
        manifest = build_job_manifest(
            spec, self.endpoint, image=self.image, command=self.command, namespace=self.namespace,
            timeout_s=self.timeout_s,
        )  # fmt: skip
        started = time.monotonic()
        name = manifest["metadata"]["name"]
        code, _, err = await _kubectl(["apply", "-f", "-"], json.dumps(manifest))
        if code != 0:
            outcome = RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"kubectl apply failed: {err.strip()}")
        else:
            try:
                outcome = await self._watch(spec, name)
            except asyncio.CancelledError:
                await _kubectl(["delete", "job", name, "-n", self.namespace, "--wait=false"])
                raise
        outcome.seconds = time.monotonic() - started
        await call_hook(self.on_exit, outcome)
        return outcome

    async def _watch(self, spec: RolloutSpec, name: str) -> RolloutOutcome:
        while True:
            code, out, err = await _kubectl(["get", "job", name, "-n", self.namespace, "-o", "json"])
            if code == 0:
                cause = classify_job(json.loads(out).get("status", {}))
                if cause is not None:
                    return RolloutOutcome(spec, cause, 0 if cause is Cause.OK else None, message=f"job {name}")
            await asyncio.sleep(POLL_S)


async def _kubectl(args: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        "kubectl", *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else None,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate(stdin.encode() if stdin is not None else None)
    return process.returncode or 0, out.decode(), err.decode()
