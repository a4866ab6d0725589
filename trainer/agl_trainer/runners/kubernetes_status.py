"""How a rollout's Job ended, or why it has not started, read from Job and Pod objects (JSON dicts).

Pure functions of what the API server reports, so the watch, the reconcile and the tests share
them. Causes are the store's vocabulary (runners.base.Cause): a harness that exits non-zero is a
harness_error; the deadline is a timeout; a pod evicted, preempted or that never starts (image pull,
unschedulable, quota) is an infra_error, which the runner retries as the next attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agl_trainer.runners.base import EXIT_INFRA_RETRY, Cause
from agl_trainer.runners.kubernetes_manifest import CONTAINER

# Waiting reasons that no amount of waiting fixes: fail the attempt at once.
PERMANENT_WAITING = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})
# Waiting reasons that may clear (a registry hiccup): fail once they last harness.kubernetes.start_timeout_s.
STUCK_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "CreateContainerError", "RegistryUnavailable"})
# Pod-level reasons for a pod the node or the scheduler took away: not the harness's fault.
INFRA_POD_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "Shutdown", "NodeShutdown", "Terminated"})


@dataclass(frozen=True)
class Verdict:
    cause: Cause
    message: str
    exit_code: int | None = None


@dataclass(frozen=True)
class NotStarted:
    """Why the Job's pod is not running yet; `permanent` ones fail at once, others after a timeout."""

    reason: str
    message: str
    permanent: bool = False


def _conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list((obj.get("status") or {}).get("conditions") or [])


def job_finished(job: dict[str, Any]) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in _conditions(job))


def classify_job(status: dict[str, Any]) -> Cause | None:
    """None while running; how the Job ended otherwise (from the Job's status alone)."""
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


def _harness_state(pod: dict[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER:
            return status.get("state") or {}
    return {}


def job_verdict(job: dict[str, Any], pods: list[dict[str, Any]]) -> Verdict | None:
    """The outcome of a finished Job, with the harness's exit code from its pod when known."""
    status = job.get("status") or {}
    cause = classify_job(status)
    if cause is None:
        return None
    name = (job.get("metadata") or {}).get("name", "?")
    if cause is Cause.OK:
        return Verdict(Cause.OK, f"job {name} complete", 0)
    failed = next((c for c in _conditions(job) if c.get("type") == "Failed" and c.get("status") == "True"), {})
    detail = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".rstrip(": ")
    if cause is Cause.TIMEOUT:
        return Verdict(Cause.TIMEOUT, f"job {name}: {detail}")
    for pod in pods:
        terminated = _harness_state(pod).get("terminated")
        pod_reason = (pod.get("status") or {}).get("reason")
        if pod_reason in INFRA_POD_REASONS and not terminated:
            message = (pod.get("status") or {}).get("message", "")
            return Verdict(Cause.INFRA_ERROR, f"job {name}: pod {pod_reason}: {message}".rstrip(": "))
        if terminated:
            code = terminated.get("exitCode")
            why = terminated.get("reason") or ""
            if code == EXIT_INFRA_RETRY:
                return Verdict(Cause.INFRA_ERROR, f"job {name}: harness exited {code} (retry me)", code)
            if why == "OOMKilled":
                return Verdict(
                    Cause.HARNESS_ERROR,
                    f"job {name}: OOMKilled (fix: raise harness.kubernetes.resources.limits.memory)",
                    code,
                )
            if code:
                return Verdict(Cause.HARNESS_ERROR, f"job {name}: harness exited {code} {why}".rstrip(), code)
    return Verdict(cause, f"job {name}: {detail}")


def not_started(pods: list[dict[str, Any]]) -> NotStarted | None:
    """Why no pod of the Job runs yet (None when one runs or ran, or none is pending for a reason)."""
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") not in (None, "Pending"):
            return None
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in PERMANENT_WAITING or reason in STUCK_WAITING:
                message = f"pod {name}: {reason}: {waiting.get('message', '')}".rstrip(": ")
                return NotStarted(reason, message, permanent=reason in PERMANENT_WAITING)
        for condition in _conditions(pod):
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                reason = condition.get("reason") or "Unschedulable"
                return NotStarted(reason, f"pod {name}: {reason}: {condition.get('message', '')}".rstrip(": "))
    return None
