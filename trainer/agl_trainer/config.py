"""`agl train` configuration: one YAML file, every key also a command-line flag.

The config is typed once, here, with msgspec Structs, and validated before anything starts. Errors
name the key and say how to fix it:

    config key loop.group_size: expected int >= 1, got 0 (fix: set loop.group_size to 1 or more)

Overrides: `--loop.batch_rollouts 64`, `--loop.batch_rollouts=64` or `--set loop.batch_rollouts=64`;
values are read as YAML scalars (`1e-3`, `true`, `[a, b]`). `describe_keys()` lists every key with
its default and meaning (`agl train --help` prints it).
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from agl_trainer.assembly.config import AssemblyConfig  # the `assembly` section

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


def _doc(text: str, **constraints: Any) -> Any:
    return msgspec.Meta(description=text, **constraints)


class ConfigError(ValueError):
    """A config problem, phrased for the user: the key, what is wrong, and the fix."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class KubernetesConfig(_Section):
    """The Job each rollout runs as with harness.runner=kubernetes (runners/kubernetes_manifest.py)."""

    kubeconfig: Annotated[
        str | None, _doc("kubeconfig file (default: the pod's service account in a cluster, else ~/.kube/config)")
    ] = None
    context: Annotated[str | None, _doc("kubeconfig context (default: its current context)")] = None
    sidecar_url: Annotated[
        str | None, _doc("the sidecar's URL as pods reach it (default: sidecar.advertise_url)")
    ] = None
    otlp_endpoint: Annotated[
        str | None, _doc("the OTLP endpoint pods send SDK spans to (default: receiver.advertise_url)")
    ] = None
    service_account: Annotated[str | None, _doc("the pods' service account")] = None
    resources: Annotated[
        dict[str, dict[str, str | int | float]],
        _doc("the harness container's requests and limits: {requests: {cpu: 500m, memory: 1Gi}, limits: {...}}"),
    ] = {}
    node_selector: Annotated[dict[str, str], _doc("node labels the pods must run on")] = {}
    tolerations: Annotated[
        list[dict[str, Any]], _doc("pod tolerations, as in a pod spec: [{key, operator, value, effect}]")
    ] = []
    env_from_secrets: Annotated[list[str], _doc("secrets whose every key becomes an environment variable")] = []
    secret_env: Annotated[
        dict[str, str], _doc("environment variables from secret keys: {NAME: secret-name/key}")
    ] = {}
    image_pull_policy: Annotated[
        Literal["Always", "IfNotPresent", "Never"] | None, _doc("the container's imagePullPolicy")
    ] = None
    image_pull_secrets: Annotated[list[str], _doc("secrets for pulling harness.image from a private registry")] = []
    labels: Annotated[dict[str, str], _doc("extra labels on Jobs and pods")] = {}
    annotations: Annotated[dict[str, str], _doc("extra annotations on Jobs and pods")] = {}
    ttl_s: Annotated[int, _doc("a finished Job is deleted after this many seconds (ttlSecondsAfterFinished)", ge=0)] = 600
    max_jobs: Annotated[int, _doc("most Jobs at once (0: loop.concurrency)", ge=0)] = 0
    create_rate: Annotated[float, _doc("most Job creations per second", gt=0)] = 5.0
    start_timeout_s: Annotated[
        float,
        _doc("a pod that cannot start (image pull back-off, unschedulable, no pod: quota) for this long fails "
             "the attempt with the reason (infra_error, retried)", gt=0),
    ] = 300.0
    reconcile_s: Annotated[float, _doc("list Jobs and pods this often, for events a watch missed", gt=0)] = 15.0
    api_tries: Annotated[
        int,
        _doc("tries of an API call while the API server does not answer or answers 429/5xx (backoff with "
             "jitter between them); then the attempt fails as infra_error", ge=1),
    ] = 6
    api_backoff_max_s: Annotated[
        float, _doc("the longest wait between two tries of an API call (Retry-After included)", ge=0.5)
    ] = 30.0


class HarnessConfig(_Section):
    command: Annotated[
        list[str] | str | None,
        _doc("the harness command, run once per rollout (a string is split like a shell would)"),
    ] = None
    function: Annotated[
        str | None,
        _doc("a Python harness `module:function(task, base_url)`, called once per rollout in runner workers"),
    ] = None
    grader: Annotated[
        list[str] | str | None,
        _doc("optional command run after a rollout; prints its reward (a number) on stdout"),
    ] = None
    cwd: Annotated[str | None, _doc("working directory of harness processes (default: current)")] = None
    env: Annotated[dict[str, str], _doc("extra environment variables for the harness")] = {}
    timeout_s: Annotated[float, _doc("a rollout running longer is killed (its process group)", gt=0)] = 300.0
    retries: Annotated[int, _doc("retries per rollout for infrastructure failures (never harness errors)", ge=0)] = 2
    workers: Annotated[int, _doc("runner worker processes for a `function` harness", ge=1)] = 2
    log_dir: Annotated[str | None, _doc("per-rollout logs (default: OUTPUT_DIR/rollouts)")] = None
    runner: Annotated[Literal["local", "kubernetes"], _doc("where harness processes run")] = "local"
    image: Annotated[str | None, _doc("container image for the kubernetes runner")] = None
    namespace: Annotated[str, _doc("kubernetes namespace")] = "default"
    kubernetes: KubernetesConfig = msgspec.field(default_factory=KubernetesConfig)


class ModelConfig(_Section):
    path: Annotated[str | None, _doc("a Hugging Face model directory (or the tiny demo model when built)")] = None
    name: Annotated[str, _doc("the model name the engine serves (what harnesses send as `model`)")] = "tiny"


class VerlConfig(_Section):
    """Where verl's workers run. The same config runs on a laptop CPU, one GPU, one node or several."""

    nnodes: Annotated[int, _doc("machines in the Ray cluster that run training workers (verl's trainer.nnodes)", ge=1)] = 1
    n_gpus_per_node: Annotated[
        int, _doc("training workers per machine: GPUs, or processes on a CPU (verl's trainer.n_gpus_per_node)", ge=1)
    ] = 1
    ray_address: Annotated[
        str | None,
        _doc("an existing Ray cluster (`auto`, `HOST:6379`, `ray://HOST:10001`); null starts a local one"),
    ] = None
    strategy: Annotated[Literal["fsdp2"], _doc("verl's actor strategy (FSDP2)")] = "fsdp2"
    param_offload: Annotated[bool, _doc("offload parameters to CPU between steps (collocated GPUs)")] = False
    optimizer_offload: Annotated[bool, _doc("offload optimizer state to CPU between steps")] = False
    gradient_checkpointing: Annotated[bool, _doc("recompute activations in backward (less memory)")] = False
    ulysses_sequence_parallel_size: Annotated[int, _doc("Ulysses sequence parallelism per model replica", ge=1)] = 1
    weight_sync: Annotated[
        Literal["auto", "in_place", "nccl", "cuda_ipc"],
        _doc("how new weights reach the engine: in_place (gathered tensors through the engine's load path), "
             "nccl or cuda_ipc (vLLM's GPU weight transfer); auto picks cuda_ipc on GPUs, in_place on CPU"),
    ] = "auto"
    override: Annotated[
        dict[str, Any], _doc("verl actor config keys by dotted name, applied last (e.g. fsdp_config.wrap_policy...)")
    ] = {}


class BackendConfig(_Section):
    name: Annotated[Literal["torch", "verl"], _doc("training backend")] = "torch"
    lr: Annotated[float, _doc("learning rate", gt=0)] = 1e-3
    device: Annotated[str, _doc("torch device: auto, cpu, cuda or cuda:N")] = "auto"
    algorithm: Annotated[
        dict[str, Any],
        _doc("algorithm settings by name (advantage_estimator: grpo, loss_agg_mode, importance_cap, ...)"),
    ] = {}
    options: Annotated[
        dict[str, Any], _doc("further backend settings by name (micro_batch_tokens, warmup_steps, ...)")
    ] = {}
    verl: VerlConfig = msgspec.field(default_factory=VerlConfig)


class EngineConfig(_Section):
    name: Annotated[Literal["embedded", "vllm"], _doc("inference engine")] = "embedded"
    replicas: Annotated[int, _doc("engine servers (vllm)", ge=1)] = 1
    max_batch: Annotated[int, _doc("largest batch of concurrent requests the engine generates together", ge=1)] = 256
    options: Annotated[dict[str, Any], _doc("further engine options, passed through by name")] = {}


class SamplingConfig(_Section):
    temperature: Annotated[float, _doc("sampling temperature", ge=0)] = 1.0
    top_p: Annotated[float, _doc("nucleus sampling", gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, _doc("cap on generated tokens per call (0: the harness decides)", ge=0)] = 0


class SamplingModes(_Section):
    train: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    val: SamplingConfig = msgspec.field(default_factory=lambda: SamplingConfig(temperature=0.0))

    def for_mode(self, mode: str) -> SamplingConfig:
        return self.val if mode == "val" else self.train


class AttachedSidecar(_Section):
    """A sidecar you run (e.g. one per engine node) that `agl train` drives by its admin API."""

    url: Annotated[str, _doc("the sidecar's URL as the trainer reaches it (admin API)")]
    admin_token_env: Annotated[str | None, _doc("environment variable holding its admin token")] = None
    harness_url: Annotated[str | None, _doc("the URL harnesses use for it (default: url)")] = None
    harness_key_env: Annotated[str | None, _doc("environment variable holding the key its harnesses send")] = None
    upstreams: Annotated[
        list[str] | None,
        _doc("the engine servers it forwards to, as it reaches them (e.g. its node's vLLM at "
             "http://127.0.0.1:8000); null: all of the engine's URLs"),
    ] = None


class SidecarSection(_Section):
    url: Annotated[str | None, _doc("use an already running sidecar at this URL instead of starting one")] = None
    admin_token: Annotated[str | None, _doc("its admin token (default: a fresh random one)")] = None
    executable: Annotated[str | None, _doc("agl-sidecar to run (default: the one next to this Python)")] = None
    max_hold_s: Annotated[float, _doc("a call held longer than this while training gets 503", gt=0)] = 600.0
    startup_timeout_s: Annotated[float, _doc("how long to wait for the sidecar's /healthz", gt=0)] = 30.0
    # Addresses and auth of the sidecar `agl train` starts (docs/operations.md, "Addresses and auth").
    listen: Annotated[
        str, _doc("HOST:PORT the started sidecar listens on (port 0: a free one; 0.0.0.0 or [::]: every interface)")
    ] = "127.0.0.1:0"
    advertise_url: Annotated[
        str | None, _doc("the URL harnesses use to reach the sidecar (required when listen is a wildcard address)")
    ] = None
    auth: Annotated[
        bool | Literal["auto"],
        _doc("harness key (true/false; auto: on when the sidecar is not on loopback); the admin token is always on"),
    ] = "auto"
    harness_key_env: Annotated[
        str | None, _doc("environment variable holding the key harnesses must send (default: a generated one)")
    ] = None
    admin_token_env: Annotated[
        str | None, _doc("environment variable holding the admin token (default: admin_token, else generated)")
    ] = None
    otlp_endpoint: Annotated[
        str | None, _doc("where the sidecar exports spans, e.g. an OpenTelemetry Collector (default: the receiver)")
    ] = None
    attach: Annotated[
        list[AttachedSidecar],
        _doc("sidecars you run (one per engine node): [{url, admin_token_env, harness_url, harness_key_env}]; "
             "`agl train` drives them instead of starting its own"),
    ] = []


class ReceiverSection(_Section):
    """Where the trainer's OTLP receiver listens and how senders reach it."""

    listen: Annotated[str, _doc("HOST:PORT of the receiver's OTLP/HTTP endpoint (port 0: a free one)")] = "127.0.0.1:0"
    advertise_url: Annotated[
        str | None,
        _doc("the URL sidecars and SDKs send spans to (required when listen is a wildcard address)"),
    ] = None
    auth: Annotated[
        bool | Literal["auto"], _doc("bearer token on /v1/traces (true/false; auto: on when not on loopback)")
    ] = "auto"
    token_env: Annotated[
        str | None, _doc("environment variable holding the receiver's token (default AGL_RECEIVER_TOKEN, else generated)")
    ] = None


class OfflineConfig(_Section):
    """`agl train CONFIG --from-store traces.db`: train on rollouts collected earlier."""

    max_policy_lag: Annotated[
        int,
        _doc("drop rollouts whose tokens are more than this many policy versions older than the weights "
             "being trained (policy_version plus the steps taken; -1: no bound)", ge=-1),
    ] = -1
    policy_version: Annotated[
        int,
        _doc("the policy version the store's calls give model.path's weights (what the engine serving them "
             "reported); the weights trained are this plus the steps taken. Staleness and max_policy_lag "
             "are measured against them; rollouts with a newer version are skipped", ge=0),
    ] = 0
    max_age_s: Annotated[
        float, _doc("drop rollouts completed longer ago than this many seconds (0: no bound)", ge=0)
    ] = 0.0
    min_group_size: Annotated[
        int, _doc("train a task's rollouts only once this many of them are in the store (GRPO needs 2+)", ge=1)
    ] = 2
    quiet_s: Annotated[
        float,
        _doc("a rollout that never sent its end (no agl.rollout around the harness) counts as ended once "
             "its last span is this many seconds old", ge=0),
    ] = 600.0


class LoopConfig(_Section):
    mode: Annotated[
        Literal["sync", "collocated-async"],
        _doc("sync: batch, wait, train; collocated-async: keep rollouts in flight, pause to train"),
    ] = "collocated-async"
    batch_rollouts: Annotated[int, _doc("rollouts per training step (a multiple of group_size)", ge=1)] = 64
    group_size: Annotated[int, _doc("rollouts per task in a step (the advantage group)", ge=1)] = 8
    staleness: Annotated[int, _doc("most policy versions a trained call may lag behind", ge=0)] = 1
    stale_policy: Annotated[
        Literal["wait", "drop"],
        _doc("a rollout about to exceed the staleness bound: wait for it before updating, or drop it"),
    ] = "wait"
    concurrency: Annotated[int, _doc("most rollouts in flight at once", ge=1)] = 64
    max_steps: Annotated[int, _doc("stop after this many training steps", ge=1)] = 100
    max_train_s: Annotated[float, _doc("stop after this many seconds of training (0: no limit)", ge=0)] = 0.0
    checkpoint_every: Annotated[int, _doc("save a checkpoint every N steps (resume restarts there)", ge=1)] = 1
    drain_timeout_s: Annotated[float, _doc("how long a pause waits for in-flight calls", gt=0)] = 60.0
    switch: Annotated[
        Literal["drain", "keep"],
        _doc(
            "policy switch at each update: drain (wait for in-flight calls to finish) or keep (the engine "
            "freezes them, new weights load, they continue; tokens carry their versions; collocated-async only)"
        ),
    ] = "drain"
    completion_grace_s: Annotated[float, _doc("after a harness exits, wait this long for late spans", ge=0)] = 2.0
    failed_rollouts: Annotated[
        Literal["drop", "zero"], _doc("failed rollouts (harness error, timeout): drop them or train with reward 0")
    ] = "drop"
    val_every: Annotated[
        int,
        _doc("validate on val_tasks before the first step, every N steps and at the end (0: never)", ge=0),
    ] = 0
    val_repeats: Annotated[int, _doc("rollouts per val task in a validation round", ge=1)] = 1
    val_sampled: Annotated[
        int,
        _doc("also run each val task this many times at sampling.train (mean@k: val/sampled/reward; 0: off)", ge=0),
    ] = 0


class CanarySection(_Section):
    """Probe sequences scored by the engine and the trainer after every weight sync (loop/canary.py)."""

    enabled: Annotated[bool, _doc("run the canary at start and after every weight sync")] = True
    action: Annotated[
        Literal["warn", "stop"], _doc("a disagreement: warn (log it, metrics agreement/canary/*) or stop the run")
    ] = "warn"
    tolerance: Annotated[
        float, _doc("mean |engine - trainer| logprob per probe kind, in nats, that still agrees", gt=0)
    ] = 0.05
    probes: Annotated[int, _doc("fixed probe sequences scored by prompt logprobs", ge=1, le=64)] = 4
    tokens: Annotated[int, _doc("tokens per probe sequence", ge=4, le=4096)] = 32
    generate: Annotated[int, _doc("tokens the cached-prefix and fresh probes generate", ge=1, le=256)] = 2


class DiagnosticsSection(_Section):
    canary: CanarySection = msgspec.field(default_factory=CanarySection)


class ViewerSection(_Section):
    """The trace viewer a running `agl train` serves over its store (agl traces serve's pages)."""

    enabled: Annotated[bool, _doc("serve the trace viewer while training (its address is printed at start)")] = True
    listen: Annotated[
        str,
        _doc("HOST:PORT for the viewer (port 0: any free port; a busy port falls back to a free one)",
             pattern=r"^(\[[0-9A-Fa-f:.]+\]|[^:\s]*):[0-9]{1,5}$"),
    ] = "127.0.0.1:8500"
    token_env: Annotated[
        str,
        _doc("environment variable holding the viewer's token; off loopback the viewer needs one (clients send"
             " 'Authorization: Bearer <token>' or open /?token=<token> once) and is not served without it"),
    ] = "AGL_VIEWER_TOKEN"


class WandbSection(_Section):
    """Weights & Biases (metrics.trackers: [wandb]); pip install 'agl[trackers]'."""

    project: Annotated[str, _doc("the W&B project")] = "agl"
    entity: Annotated[str | None, _doc("the W&B entity (team or user; default: your default entity)")] = None
    run_name: Annotated[str | None, _doc("the run's name (default: the output directory's name)")] = None
    mode: Annotated[
        Literal["online", "offline", "disabled"] | None,
        _doc("online, offline (writes OUTPUT_DIR/wandb, `wandb sync` later) or disabled (default: WANDB_MODE, "
             "else online)"),
    ] = None
    tags: Annotated[list[str], _doc("tags on the run")] = []


class MlflowSection(_Section):
    """MLflow (metrics.trackers: [mlflow]); pip install 'agl[trackers]' (mlflow-skinny)."""

    tracking_uri: Annotated[
        str | None,
        _doc("the tracking server (http://host:5000) or a file store (file:/path/mlruns); default: "
             "MLFLOW_TRACKING_URI, else file:OUTPUT_DIR/mlruns"),
    ] = None
    experiment: Annotated[str, _doc("the experiment's name (created when missing)")] = "agl"
    run_name: Annotated[str | None, _doc("the run's name (default: the output directory's name)")] = None


class MetricsSection(_Section):
    """Where metrics go beside metrics.jsonl, metrics.prom and tensorboard/ (always written)."""

    trackers: Annotated[
        list[Literal["wandb", "mlflow"]],
        _doc("experiment trackers that also get every metric and evaluation result: [wandb, mlflow]; a "
             "tracker that cannot start stops the run before it starts, one that fails later warns once"),
    ] = []
    wandb: WandbSection = msgspec.field(default_factory=WandbSection)
    mlflow: MlflowSection = msgspec.field(default_factory=MlflowSection)


class EvalSection(_Section):
    """`agl eval CONFIG`: k attempts a task through the same harness, sidecar and runner as training."""

    tasks: Annotated[
        str | None, _doc("the tasks to evaluate (JSONL like tasks; default: val_tasks, else tasks)")
    ] = None
    k: Annotated[int, _doc("attempts per task (pass@k, mean@k)", ge=1, le=1024)] = 4
    mode: Annotated[
        Literal["train", "val"],
        _doc("the sampling the attempts get: train (sampling.train) or val (sampling.val, greedy by default)"),
    ] = "train"
    max_turns: Annotated[
        int, _doc("the harness's turn budget, handed to it as AGL_MAX_TURNS and kept in the receipt (0: none)", ge=0)
    ] = 0
    context_tokens: Annotated[
        int,
        _doc("the context budget in tokens, handed to the harness as AGL_CONTEXT_TOKENS and kept in the receipt "
             "(0: none)", ge=0),
    ] = 0
    pass_reward: Annotated[float, _doc("a reward at or above this passes (pass@k)")] = 1.0
    model_url: Annotated[
        str | None,
        _doc("evaluate a model served elsewhere: an OpenAI-compatible base URL (http://host:8000/v1), "
             "instead of model.path in the embedded or vLLM engine"),
    ] = None
    output_dir: Annotated[str, _doc("where results.json, receipt.json and rollouts.db go (must be new)")] = "runs/eval"
    budget_mismatch: Annotated[
        Literal["refuse", "warn"],
        _doc("agl eval --compare of two receipts whose budgets or sampling differ: refuse (exit 1) or warn"),
    ] = "refuse"


class Config(_Section):
    tasks: Annotated[str | None, _doc("tasks, one JSON object a line (an `id` field names the task)")] = None
    val_tasks: Annotated[
        str | None, _doc("held-out tasks for validation (JSONL like tasks; run in mode val, never trained)")
    ] = None
    output_dir: Annotated[str, _doc("where checkpoints, logs, metrics and plots go")] = "runs/agl"
    seed: Annotated[int, _doc("seed for task order, sampling and initialisation")] = 0
    harness: HarnessConfig = msgspec.field(default_factory=HarnessConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    backend: BackendConfig = msgspec.field(default_factory=BackendConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    sampling: SamplingModes = msgspec.field(default_factory=SamplingModes)
    sidecar: SidecarSection = msgspec.field(default_factory=SidecarSection)
    loop: LoopConfig = msgspec.field(default_factory=LoopConfig)
    receiver: ReceiverSection = msgspec.field(default_factory=ReceiverSection)
    offline: OfflineConfig = msgspec.field(default_factory=OfflineConfig)
    viewer: ViewerSection = msgspec.field(default_factory=ViewerSection)
    diagnostics: DiagnosticsSection = msgspec.field(default_factory=DiagnosticsSection)
    assembly: AssemblyConfig = msgspec.field(default_factory=AssemblyConfig)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    metrics: MetricsSection = msgspec.field(default_factory=MetricsSection)


# --- loading ---------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, check_paths: bool = True) -> Config:
    """Read YAML at `path` (or start from defaults), apply `overrides`, validate, and return a Config."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    config = validate(raw)
    if check_paths:
        check_config(config, base=Path(path).parent if path else Path.cwd())
    return config


def validate(raw: dict[str, Any]) -> Config:
    try:
        return msgspec.convert(raw, Config, strict=False)  # strict=False: "1e-3" from a flag is a float
    except msgspec.ValidationError as error:
        raise ConfigError(_explain(str(error))) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (fix: pass the path of a YAML file)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    except UnicodeDecodeError as error:  # read_text: a binary or Latin-1 file
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {error.start}; fix: save it as UTF-8)") from None
    except OSError as error:  # unreadable (permissions)
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def parse_overrides(args: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """`--a.b 1`, `--a.b=1`, `--set a.b=1` -> ("a.b", 1); values parsed as YAML scalars."""
    import yaml

    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        if arg == "--set":
            if i + 1 >= len(items) or "=" not in items[i + 1]:
                raise ConfigError("--set needs KEY=VALUE, for example --set loop.batch_rollouts=64")
            key, text = items[i + 1].split("=", 1)
            i += 2
        elif arg.startswith("--") and len(arg) > 2:
            if "=" in arg:
                key, text = arg[2:].split("=", 1)
                i += 1
            elif i + 1 < len(items) and not items[i + 1].startswith("--"):
                key, text = arg[2:], items[i + 1]
                i += 2
            else:
                raise ConfigError(f"flag {arg} needs a value, for example {arg}=VALUE")
        else:
            raise ConfigError(f"unexpected argument {arg!r} (config keys are flags: --loop.group_size 8)")
        key = key.strip().replace("-", "_") if not key.startswith("harness.env.") else key
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        yield key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _explain(message: str) -> str:
    """Rephrase a msgspec validation error as 'config key K: problem (fix: ...)'."""
    match = _AT.search(message)
    path = match.group("path") if match else ""
    key = re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
    problem = _AT.sub("", message)
    unknown = re.match(r"Object contains unknown field `(?P<name>[^`]+)`", problem)
    if unknown:
        name = unknown.group("name")
        full = f"{key}.{name}" if key else name
        known = [k for k, _, _ in describe_keys()]
        close = difflib.get_close_matches(full, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see `agl train --help` for the keys"
        return f"config key {full}: unknown key (fix: {hint})"
    problem = problem.replace("`", "")
    problem = problem[0].lower() + problem[1:] if problem else problem
    fix = _fix_for(key)
    return f"config key {key or '(top level)'}: {problem}" + (f" (fix: {fix})" if fix else "")


def _fix_for(key: str) -> str:
    for name, default, description in describe_keys():
        if name == key:
            choices = _choices(key)
            text = f"one of {', '.join(choices)}: {description}" if choices else description
            return f"{text}; default {default!r}" if default is not None else text
    return ""


def _choices(key: str) -> list[str]:
    """The allowed values of a Literal-typed key."""
    node: Any = Config
    for part in key.split("."):
        hints = msgspec.structs.fields(node)
        match = [f for f in hints if f.name == part]
        if not match:
            return []
        node = match[0].type
    args = getattr(node, "__metadata__", None) and node.__origin__
    literal = args if args is not None else node
    if getattr(literal, "__origin__", None) is Literal:
        return [str(value) for value in literal.__args__]
    return []


def describe_keys() -> list[tuple[str, Any, str]]:
    """Every config key as (dotted name, default, description), in declaration order."""
    out: list[tuple[str, Any, str]] = []

    def walk(struct_type: type, prefix: str) -> None:
        info = msgspec.inspect.type_info(struct_type)
        for field in info.fields:  # type: ignore[attr-defined]
            name = prefix + field.name
            ftype = field.type
            if isinstance(ftype, msgspec.inspect.StructType):
                walk(ftype.cls, name + ".")
                continue
            description = ""
            if isinstance(ftype, msgspec.inspect.Metadata):
                description = (ftype.extra_json_schema or {}).get("description", "") or ""
            default = None
            if field.default is not msgspec.NODEFAULT:
                default = field.default
            out.append((name, default, description))

    walk(Config, "")
    return out


# --- checks beyond types ---------------------------------------------------------------------


def harness_argv(value: list[str] | str) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def check_config(config: Config, base: Path) -> None:
    """Cross-field checks and the things that must exist before anything starts."""
    loop, harness = config.loop, config.harness
    if config.tasks is None:
        raise ConfigError("config key tasks: missing (fix: set tasks to a JSONL file, one task per line)")
    if not Path(config.tasks).is_file():
        raise ConfigError(f"config key tasks: {config.tasks} does not exist (fix: point it at a JSONL file)")
    check_val_tasks(config)
    if harness.runner == "kubernetes":  # the command runs in the image: nothing to find on this machine
        from agl_trainer.runners.kubernetes_config import check_kubernetes

        check_kubernetes(config)
    elif (harness.command is None) == (harness.function is None):
        raise ConfigError(
            "config key harness: set exactly one of harness.command (a program run per rollout) "
            "or harness.function (module:function called per rollout)"
        )
    if harness.command is not None and harness.runner != "kubernetes":
        argv = harness_argv(harness.command)
        if not argv:
            raise ConfigError("config key harness.command: empty (fix: the program to run per rollout)")
        _check_program("harness.command", argv[0], harness.cwd)
    if harness.grader is not None:
        argv = harness_argv(harness.grader)
        if not argv:
            raise ConfigError("config key harness.grader: empty (fix: remove it or name a program)")
        _check_program("harness.grader", argv[0], harness.cwd)
    if harness.function is not None and not re.fullmatch(r"[\w.]+:[\w.]+", harness.function):
        raise ConfigError(
            f"config key harness.function: {harness.function!r} is not module:function "
            "(fix: for example examples.demo.harness:run_episode)"
        )
    if harness.runner == "kubernetes" and not harness.image:
        raise ConfigError("config key harness.image: the kubernetes runner needs a container image")
    if loop.batch_rollouts % loop.group_size:
        raise ConfigError(
            f"config key loop.batch_rollouts: {loop.batch_rollouts} is not a multiple of loop.group_size="
            f"{loop.group_size} (fix: use {max(1, loop.batch_rollouts // loop.group_size) * loop.group_size})"
        )
    if loop.switch == "keep" and loop.mode != "collocated-async":
        raise ConfigError(
            "config key loop.switch: keep freezes calls in flight across an update, which only "
            "loop.mode=collocated-async has (fix: loop.switch=drain, or loop.mode=collocated-async)"
        )
    if config.model.path is None:
        raise ConfigError("config key model.path: missing (fix: a Hugging Face model directory)")
    if not Path(config.model.path).exists():
        raise ConfigError(f"config key model.path: {config.model.path} does not exist (fix: a model directory)")


def _check_program(key: str, program: str, cwd: str | None) -> None:
    if "/" in program:
        candidate = Path(cwd or ".") / program if not Path(program).is_absolute() else Path(program)
        if not candidate.exists():
            raise ConfigError(f"config key {key}: {program} does not exist (fix: check the path)")
        return
    if shutil.which(program) is None:
        raise ConfigError(f"config key {key}: program {program!r} is not on PATH (fix: install it or give its path)")


def check_val_tasks(config: Config) -> None:
    """val_tasks and loop.val_every go together; the file must be readable tasks held out from `tasks`."""
    every, path = config.loop.val_every, config.val_tasks
    if every > 0 and path is None:
        raise ConfigError(
            f"config key loop.val_every: {every} needs held-out tasks (fix: set val_tasks to a JSONL file "
            "of tasks not in `tasks`, or loop.val_every to 0)"
        )
    if path is None:
        return
    if not Path(path).is_file():
        raise ConfigError(f"config key val_tasks: {path} does not exist (fix: point it at a JSONL file)")
    if config.tasks is not None and Path(path).resolve() == Path(config.tasks).resolve():
        raise ConfigError(
            f"config key val_tasks: {path} is the training tasks file; validation needs held-out tasks "
            "(fix: a separate JSONL file)"
        )
    read_val_tasks(path)


def read_val_tasks(path: str | Path) -> list[dict[str, Any]]:
    """read_tasks for `val_tasks`: its errors name the config key."""
    try:
        return read_tasks(path)
    except ConfigError as error:
        raise ConfigError(f"config key val_tasks: {error}") from None


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The tasks, each a JSON object with an `id` (added as the line number when missing)."""
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"tasks file {path} line {number}: not JSON ({error.msg})") from None
            if not isinstance(task, dict):
                raise ConfigError(f"tasks file {path} line {number}: a task must be a JSON object")
            task_id = str(task.get("id", task.get("task_id", f"task-{number}")))
            if task_id in seen:
                raise ConfigError(f"tasks file {path} line {number}: duplicate task id {task_id!r}")
            seen.add(task_id)
            task.setdefault("id", task_id)
            tasks.append(task)
    if not tasks:
        raise ConfigError(f"tasks file {path} holds no tasks (fix: one JSON object per line)")
    return tasks


def dump_config(config: Config) -> str:
    import yaml

    return yaml.safe_dump(msgspec.to_builtins(config), sort_keys=False)


if __name__ == "__main__":  # pragma: no cover - a quick way to list the keys
    for key, default, description in describe_keys():
        print(f"{key:32} {default!r:>12}  {description}", file=sys.stdout)
