"""The parts of a run, each built from the config in one place: the backend, the engine, the
runner, the validation rounds and the sidecar's settings file. `agl train`, `agl train --from-store`
and `agl eval` build theirs here; errors are ConfigErrors naming the key and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agl_trainer.config import Config, ConfigError, harness_argv
from agl_trainer.config_schema import EmbeddedEngineSection
from agl_trainer.engines.base import InferenceEngine
from agl_trainer.loop.inflight import NO_DATA_AFTER_EXIT_S
from agl_trainer.loop.validation import SETTLE_TIMEOUT_S
from agl_trainer.loop.ports import Backend
from agl_trainer.run.settings import backend_settings, vllm_engine_config
from agl_trainer.runners.base import Endpoint


def build_backend(config: Config, model_path: str) -> Backend:
    """The training backend named by backend.name, validated (errors name the key)."""
    settings = backend_settings(config, model_path)
    if config.backend.name == "verl":
        from agl_trainer.backends import BackendConfigError
        from agl_trainer.backends.verl import VerlBackend

        try:
            return VerlBackend(settings)  # checks the cluster before any worker starts
        except BackendConfigError as error:
            raise ConfigError(f"config key {error}") from None
    from agl_trainer.backends import TorchBackend

    return TorchBackend(settings)


def build_engine(config: Config, model_path: str) -> InferenceEngine:
    """The inference engine named by engine.name (not started), validated (errors name the key)."""
    if isinstance(config.engine, EmbeddedEngineSection):
        from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

        return EmbeddedEngine(
            EmbeddedEngineConfig(
                model_path=model_path,
                served_model_name=config.model.name,
                max_batch_size=config.engine.max_batch,
                options=config.engine.options,  # typed and checked as the config was read
            )
        )
    from agl_trainer.engines.vllm.engine import VLLMEngine

    return VLLMEngine(vllm_engine_config(config, model_path))


def sidecar_config_file(config: Config, path: Path, *, seed: int | None = None) -> Path:
    """The sidecar's YAML: sampling overrides per rollout mode; `seed` seeds every call (agl eval)."""
    import yaml

    sampling = {}
    for mode in ("train", "val"):
        settings = config.sampling.for_mode(mode)
        entry: dict[str, Any] = {"temperature": settings.temperature, "top_p": settings.top_p}
        if settings.max_tokens:
            entry["max_tokens"] = settings.max_tokens
        sampling[mode] = entry
    # A call whose URL names no mode is a training call: sampling.train applies to it (val rollouts'
    # URLs carry /modes/val, see Endpoint.base_url).
    settings: dict[str, Any] = {"sampling": sampling, "default_mode": "train", "spool_dir": str(path.parent / "spool")}
    if seed is not None:
        settings["sampling_seed"] = seed
    path.write_text(yaml.safe_dump(settings))
    return path


def build_runner(
    config: Config, endpoint: Endpoint, out: Path, on_exit: Any, reward_sink: Any
) -> Any:
    harness, loop = config.harness, config.loop
    log_dir = Path(harness.log_dir) if harness.log_dir else out / "rollouts"
    if harness.runner == "kubernetes":
        return build_kubernetes_runner(config, endpoint, on_exit)  # harness.kubernetes.*
    if harness.function is not None:
        from agl_trainer.runners.workers import FunctionRunner

        return FunctionRunner(
            harness.function,
            endpoint,
            workers=harness.workers,
            concurrency=loop.concurrency,
            timeout_s=harness.timeout_s,
            retries=harness.retries,
            env=dict(harness.env),
            on_exit=on_exit,
            reward_sink=reward_sink,
        )
    from agl_trainer.runners.local import CommandRunner

    return CommandRunner(
        harness_argv(harness.command),  # type: ignore[arg-type]
        endpoint,
        concurrency=loop.concurrency,
        timeout_s=harness.timeout_s,
        retries=harness.retries,
        log_dir=log_dir,
        cwd=harness.cwd,
        grader=harness_argv(harness.grader) if harness.grader else None,
        on_exit=on_exit,
        reward_sink=reward_sink,
    )


def build_kubernetes_runner(config: Config, endpoint: Endpoint, on_exit: Any = None) -> Any:
    """The runner harness.kubernetes describes; the pods' addresses replace this machine's own."""
    import dataclasses

    from agl_trainer.runners.kubernetes import KubernetesRunner
    from agl_trainer.runners.kubernetes_config import (
        check_kubernetes,
        job_template,
        pod_otlp_endpoint,
        pod_sidecar_url,
        unreachable_from_pods,
    )
    from agl_trainer.runners.kubernetes_retry import Backoff

    check_kubernetes(config)  # also when built without load_config: a function harness is refused
    kube = config.harness.kubernetes
    otlp = pod_otlp_endpoint(config) or endpoint.otlp_endpoint
    reachable = otlp is not None and not unreachable_from_pods(otlp)
    pods = dataclasses.replace(endpoint, otlp_endpoint=otlp if reachable else None)
    sidecar_url = pod_sidecar_url(config)
    if sidecar_url is not None and sidecar_url != endpoint.sidecar_url:  # one address for every pod
        pods = dataclasses.replace(pods, sidecar_url=sidecar_url)
        if getattr(endpoint, "sidecars", None):  # the started sidecar's key goes with its new address
            pods = dataclasses.replace(pods, sidecars=[(sidecar_url, endpoint.sidecars[0][1])])
    return KubernetesRunner(
        job_template(config),
        pods,
        concurrency=min(kube.max_jobs or config.loop.concurrency, config.loop.concurrency),
        create_rate=kube.create_rate,
        start_timeout_s=kube.start_timeout_s,
        reconcile_s=kube.reconcile_s,
        retries=config.harness.retries,
        on_exit=on_exit,
        kubeconfig=kube.kubeconfig,
        context=kube.context,
        log_dir=Path(config.harness.log_dir) if config.harness.log_dir else Path(config.output_dir) / "rollouts",
        backoff=Backoff(attempts=kube.api_tries, max_s=kube.api_backoff_max_s),
    )


def build_validator(
    config: Config, runner: Any, data: Any, run_id: str, out: Path | None = None, sidecar: Any = None
) -> Any:
    """The validation rounds of loop.val_every on val_tasks (loop/validation.py); None when off.
    With `out`, each round writes its receipts to OUTPUT_DIR/receipts (eval/rounds.py). With
    `sidecar` (its admin API), a round reads its rollouts once their calls' spans are delivered."""
    if config.loop.val_every <= 0 or config.val_tasks is None:
        return None
    import functools

    from agl_trainer.config import read_val_tasks
    from agl_trainer.eval.rounds import write_round_receipts
    from agl_trainer.loop.validation import Validator

    return Validator(
        read_val_tasks(config.val_tasks),
        runner=runner,
        data=data,
        run_id=run_id,
        every=config.loop.val_every,
        repeats=config.loop.val_repeats,
        sampled=config.loop.val_sampled,
        no_data_timeout_s=NO_DATA_AFTER_EXIT_S + config.loop.completion_grace_s,
        on_round=functools.partial(write_round_receipts, config, out) if out is not None else None,
        settle=(lambda: sidecar.flush(SETTLE_TIMEOUT_S)) if sidecar is not None else None,
    )


def pad_token_id(model_path: str) -> int:
    try:
        config = json.loads((Path(model_path) / "tokenizer_config.json").read_text())
        special = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 0
    pad = special.get("pad_token_id", special.get("eos_token_id", 0))
    if isinstance(pad, list):
        pad = pad[0]
    return int(pad or 0) if config is not None else 0
