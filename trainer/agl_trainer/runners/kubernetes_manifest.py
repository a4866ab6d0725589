"""The Job a rollout runs as, built from the config, and checked against the client's OpenAPI models.

One Job per rollout attempt: `backoffLimit: 0` (retries are the runner's, for infrastructure
failures only), `activeDeadlineSeconds` from harness.timeout_s, `ttlSecondsAfterFinished` so the
cluster cleans up, labels that name the rollout, the attempt and the runner that owns the Job.
The container gets the same environment as a local harness process (runners.base.Endpoint).

`check_object` walks a manifest through the official client's models (`openapi_types` and
`attribute_map`, generated from the Kubernetes OpenAPI schema): an unknown field, a wrong type or a
missing required field is an error naming its path, before anything reaches a cluster.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from agl_trainer.runners.base import Endpoint, RolloutSpec

MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLLOUT = "agl.dev/rollout-id"  # sanitised to a label value; the exact id is the annotation
LABEL_ATTEMPT = "agl.dev/attempt"
LABEL_RUNNER = "agl.dev/runner"  # one runner instance: its Jobs are the ones it watches and cleans up
LABEL_JOB = "agl.dev/job"  # on the pod template: the pod's Job, whatever labels the Job controller adds
CONTAINER = "harness"

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


@dataclass(frozen=True)
class JobTemplate:
    """Everything about a rollout's Job that comes from the config (harness.kubernetes.*)."""

    image: str
    command: list[str] | None = None  # None: the image's entrypoint
    namespace: str = "default"
    timeout_s: float = 300.0
    ttl_s: int = 600
    service_account: str | None = None
    resources: dict[str, dict[str, str]] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    env_from_secrets: list[str] = field(default_factory=list)  # whole secrets as variables (envFrom)
    secret_env: dict[str, str] = field(default_factory=dict)  # NAME -> "secret/key"
    image_pull_policy: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None


def label_value(text: str) -> str:
    """`text` as a valid label value (<= 63 chars, alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def job_name(spec: RolloutSpec, runner_id: str = "") -> str:
    """A DNS-1123 name (<= 63 chars) unique per rollout attempt (and per runner, when given)."""
    base = re.sub(r"[^a-z0-9-]", "-", spec.rollout_id.lower()).strip("-")
    suffix = (f"-{runner_id}" if runner_id else "") + f"-a{spec.attempt}"
    room = 63 - len("agl-") - len(suffix)
    if len(base) > room:  # keep distinct long ids distinct
        digest = hashlib.sha1(spec.rollout_id.encode()).hexdigest()[:8]
        base = base[: room - 9].rstrip("-") + "-" + digest
    return f"agl-{base or 'rollout'}{suffix}"


def build_job_manifest(
    spec: RolloutSpec, endpoint: Endpoint, template: JobTemplate, *, runner_id: str = ""
) -> dict[str, Any]:
    name = job_name(spec, runner_id)
    env: list[dict[str, Any]] = [
        {"name": key, "value": value}
        for key, value in sorted(endpoint.environment(spec).items())
        if key not in template.secret_env  # a secret's value wins (a harness key kept out of the Job spec)
    ]
    for var, ref in sorted(template.secret_env.items()):
        secret, key = ref.split("/", 1)
        env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    container: dict[str, Any] = {"name": CONTAINER, "image": template.image, "env": env}
    if template.command:
        container["command"] = list(template.command)
    if template.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": secret}} for secret in template.env_from_secrets]
    if template.resources:
        container["resources"] = {kind: dict(values) for kind, values in template.resources.items()}
    if template.image_pull_policy:
        container["imagePullPolicy"] = template.image_pull_policy
    if template.working_dir:
        container["workingDir"] = template.working_dir
    labels = {
        **template.labels,
        MANAGED_BY: "agl",
        LABEL_ROLLOUT: label_value(spec.rollout_id),
        LABEL_ATTEMPT: str(spec.attempt),
    }
    if runner_id:
        labels[LABEL_RUNNER] = runner_id
    annotations = {**template.annotations, LABEL_ROLLOUT: spec.rollout_id, "agl.dev/task-id": spec.task_id}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if template.service_account:
        pod_spec["serviceAccountName"] = template.service_account
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [dict(toleration) for toleration in template.tolerations]
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in template.image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": template.namespace, "labels": labels, "annotations": annotations},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": max(1, int(template.timeout_s)),
            "ttlSecondsAfterFinished": template.ttl_s,
            "template": {
                "metadata": {"labels": {**labels, LABEL_JOB: name}, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


# --- the schema check --------------------------------------------------------------------------


class ManifestError(ValueError):
    """A manifest the Kubernetes API would reject: the path of the problem and what it is."""


def check_object(value: Any, model: str, path: str = "") -> None:
    """Check `value` (JSON as sent to the API) against the client's model `model` (e.g. "V1Job"):
    unknown fields, wrong types and missing required fields raise ManifestError naming the path."""
    _check(value, model, path)
    from kubernetes.client import ApiClient

    try:  # the models' own setters enforce required fields (client_side_validation)
        ApiClient()._ApiClient__deserialize(value, model)  # type: ignore[attr-defined]
    except ValueError as error:
        raise ManifestError(f"{path or model}: {error}") from None


def check_job_manifest(manifest: dict[str, Any]) -> None:
    check_object(manifest, "V1Job")
    for kind, values in (manifest["spec"]["template"]["spec"]["containers"][0].get("resources") or {}).items():
        for resource, quantity in (values or {}).items():
            if not _QUANTITY.match(str(quantity)):
                raise ManifestError(f"resources.{kind}.{resource}: {quantity!r} is not a Kubernetes quantity")
    for where in (manifest["metadata"], manifest["spec"]["template"]["metadata"]):
        for key, value in (where.get("labels") or {}).items():
            if not _LABEL_VALUE.match(value) or len(value) > 63:
                raise ManifestError(f"metadata.labels.{key}: {value!r} is not a valid label value")


def is_quantity(text: str) -> bool:
    return bool(_QUANTITY.match(text))


def _check(value: Any, kind: str, path: str) -> None:
    where = path or "(top)"
    if value is None:
        return
    if kind.startswith("list["):
        if not isinstance(value, list):
            raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(item, kind[5:-1], f"{path}.{i}" if path else str(i))
        return
    if kind.startswith(("dict[", "dict(")):
        if not isinstance(value, dict):
            raise ManifestError(f"{where}: expected a mapping, got {type(value).__name__}")
        inner = kind[5:-1].split(",", 1)[1].strip()
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{where}: keys must be strings, got {key!r}")
            _check(item, inner, f"{path}.{key}" if path else key)
        return
    if kind == "object":  # IntOrString, RawExtension: anything JSON
        return
    if kind in ("str", "datetime", "date"):
        if not isinstance(value, str):
            raise ManifestError(f"{where}: expected a string, got {value!r}")
        return
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ManifestError(f"{where}: expected an integer, got {value!r}")
        return
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ManifestError(f"{where}: expected a number, got {value!r}")
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise ManifestError(f"{where}: expected true or false, got {value!r}")
        return
    from kubernetes.client import models

    model = getattr(models, kind, None)
    if model is None:
        raise ManifestError(f"{where}: the client has no model {kind}")
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: expected a {kind} mapping, got {type(value).__name__}")
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        attr = by_json.get(key)
        if attr is None:
            known = ", ".join(sorted(by_json))
            raise ManifestError(f"{path + '.' if path else ''}{key}: unknown field of {kind} (known: {known})")
        _check(item, model.openapi_types[attr], f"{path}.{key}" if path else key)
