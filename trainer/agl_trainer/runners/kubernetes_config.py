"""harness.runner=kubernetes: the config checks (errors name the key and the fix) and the Job template.

Checked before anything starts, with the same schema check every Job gets (kubernetes_manifest),
so a typo in a toleration or a resource quantity is a config error, not a rejected Job per rollout.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from agl_trainer.addresses import is_loopback
from agl_trainer.config_schema import Config, ConfigError, harness_argv
from agl_trainer.runners.base import Endpoint, RolloutSpec
from agl_trainer.runners.kubernetes_manifest import (
    JobTemplate,
    ManifestError,
    build_job_manifest,
    check_job_manifest,
    check_object,
    is_quantity,
)

KEY = "harness.kubernetes"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
WILDCARDS = ("0.0.0.0", "::")  # listen addresses, not places to dial


def _error(key: str, problem: str, fix: str) -> Exception:
    return ConfigError(f"config key {key}: {problem} (fix: {fix})")


def unreachable_from_pods(url: str) -> bool:
    """The URL names this machine's loopback or a wildcard address: a pod dialing it reaches itself."""
    host = urlsplit(url).hostname or ""
    return host in WILDCARDS or is_loopback(host)


def pod_sidecar_url(config: Config) -> str | None:
    """The sidecar's URL as pods reach it: harness.kubernetes.sidecar_url, else sidecar.advertise_url."""
    return config.harness.kubernetes.sidecar_url or getattr(config.sidecar, "advertise_url", None)


def pod_otlp_endpoint(config: Config) -> str | None:
    receiver = getattr(config, "receiver", None)
    return config.harness.kubernetes.otlp_endpoint or getattr(receiver, "advertise_url", None)


def _check_url(key: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _error(key, f"{url!r} is not an http(s) URL", "for example http://agl-trainer.train.svc:8400")
    if unreachable_from_pods(url):
        raise _error(
            key, f"{url} is this machine's loopback address, which pods cannot reach",
            "the address of this machine or its Service as pods see it, e.g. http://agl-trainer.train.svc:8400",
        )  # fmt: skip


def _check_labels(key: str, labels: dict[str, str]) -> None:
    for name, value in labels.items():
        prefix, _, short = name.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or not _LABEL_NAME.match(short) or len(short) > 63:
            raise _error(f"{key}.{name}", "not a valid label name", "[prefix/]name, alphanumeric, '-', '_', '.'")
        if not _LABEL_VALUE.match(value) or len(value) > 63:
            raise _error(f"{key}.{name}", f"{value!r} is not a valid label value", "<= 63 alphanumeric, '-', '_', '.'")


def check_kubernetes(config: Config) -> None:
    """Everything about harness.runner=kubernetes that can be checked without a cluster."""
    harness, kube = config.harness, config.harness.kubernetes
    if harness.function is not None:
        raise _error(
            "harness.function",
            f"{harness.function!r} is a Python function, but the kubernetes runner runs a command in a container",
            "set harness.command to a program in harness.image that calls it (it gets the task as JSON in "
            "AGL_TASK and the base URL in OPENAI_BASE_URL), or run it with harness.runner: local",
        )
    if harness.grader is not None:
        raise _error(
            "harness.grader", "a grader runs on this machine after a local process, not after a pod",
            "remove it; the harness reports its reward from the pod with agl.emit_reward()",
        )  # fmt: skip
    if not harness.image:
        raise _error("harness.image", "the kubernetes runner needs a container image", "e.g. ghcr.io/me/harness:1")
    if harness.command is not None and not harness_command(config):
        raise _error("harness.command", "empty", "the program to run in the image, or remove it for its entrypoint")
    if not _DNS_LABEL.match(harness.namespace):
        raise _error("harness.namespace", f"{harness.namespace!r} is not a namespace name", "lowercase, '-'")
    sidecar_url = pod_sidecar_url(config)
    if sidecar_url is None and not getattr(config.sidecar, "attach", None):
        raise _error(
            f"{KEY}.sidecar_url", "pods need the sidecar's address as they reach it",
            "set sidecar.listen: 0.0.0.0:8400 with sidecar.advertise_url, or harness.kubernetes.sidecar_url, "
            "e.g. http://agl-trainer.train.svc:8400",
        )  # fmt: skip
    if sidecar_url is not None:
        _check_url(f"{KEY}.sidecar_url" if kube.sidecar_url else "sidecar.advertise_url", sidecar_url)
    if kube.otlp_endpoint:
        _check_url(f"{KEY}.otlp_endpoint", kube.otlp_endpoint)
    for kind, values in kube.resources.items():
        if kind not in ("requests", "limits"):
            raise _error(f"{KEY}.resources.{kind}", "unknown", "requests and limits, e.g. {limits: {memory: 2Gi}}")
        for resource, quantity in values.items():
            if isinstance(quantity, bool) or not is_quantity(str(quantity)):
                raise _error(
                    f"{KEY}.resources.{kind}.{resource}", f"{quantity!r} is not a Kubernetes quantity",
                    "for example 500m, 2, 1Gi, 512Mi",
                )  # fmt: skip
    for i, toleration in enumerate(kube.tolerations):
        try:
            check_object(toleration, "V1Toleration")
        except ManifestError as error:
            raise _error(f"{KEY}.tolerations.{i}", str(error), "{key, operator: Equal|Exists, value, effect}") from None
    for var, ref in kube.secret_env.items():
        secret, _, key = ref.partition("/")
        if not _ENV_NAME.match(var):
            raise _error(f"{KEY}.secret_env.{var}", "not a valid environment variable name", "letters, digits, _")
        if not _DNS_SUBDOMAIN.match(secret) or not key:
            raise _error(f"{KEY}.secret_env.{var}", f"{ref!r} is not secret-name/key", "e.g. harness-keys/openai")
    for key, names in (("env_from_secrets", kube.env_from_secrets), ("image_pull_secrets", kube.image_pull_secrets)):
        for i, name in enumerate(names):
            if not _DNS_SUBDOMAIN.match(name):
                raise _error(f"{KEY}.{key}.{i}", f"{name!r} is not a secret name", "lowercase letters, digits, '-'")
    if kube.service_account is not None and not _DNS_SUBDOMAIN.match(kube.service_account):
        raise _error(f"{KEY}.service_account", f"{kube.service_account!r} is not a name", "lowercase, '-', '.'")
    _check_labels(f"{KEY}.labels", kube.labels)
    _check_labels(f"{KEY}.node_selector", kube.node_selector)
    sample = RolloutSpec("check/rollout-0", "task", {}, attempt=0)
    try:
        check_job_manifest(build_job_manifest(sample, Endpoint(sidecar_url or "http://sidecar"), job_template(config)))
    except ManifestError as error:
        raise _error(KEY, f"the Job would be rejected: {error}", "see docs/operations.md, Pods + collector") from None


def harness_command(config: Config) -> list[str] | None:
    return harness_argv(config.harness.command) if config.harness.command is not None else None


def job_template(config: Config) -> JobTemplate:
    harness, kube = config.harness, config.harness.kubernetes
    resources: dict[str, dict[str, str]] = {
        kind: {name: str(value) for name, value in values.items()} for kind, values in kube.resources.items()
    }
    tolerations: list[dict[str, Any]] = [dict(t) for t in kube.tolerations]
    return JobTemplate(
        image=harness.image or "",
        command=harness_command(config),
        namespace=harness.namespace,
        timeout_s=harness.timeout_s,
        ttl_s=kube.ttl_s,
        service_account=kube.service_account,
        resources=resources,
        node_selector=dict(kube.node_selector),
        tolerations=tolerations,
        env_from_secrets=list(kube.env_from_secrets),
        secret_env=dict(kube.secret_env),
        image_pull_policy=kube.image_pull_policy,
        image_pull_secrets=list(kube.image_pull_secrets),
        labels=dict(kube.labels),
        annotations=dict(kube.annotations),
        working_dir=harness.cwd,
    )
