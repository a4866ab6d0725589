"""The shape of `agl train`'s configuration: every section and key, typed once with msgspec Structs,
with its default, constraints and meaning (`describe_keys()` in config.py lists them). Loading,
overrides and the checks beyond types are in config.py, which re-exports what callers use.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from agl_trainer.algorithms.settings import AlgorithmSettings  # the `backend.algorithm` section
from agl_trainer.assembly.config import AssemblyConfig  # the `assembly` section
from agl_trainer.backends.settings import (  # `backend.lora`, `backend.options`, `backend.verl`
    LoraConfig,
    TrainingOptions,
    VerlSettings,
)
from agl_trainer.engines.embedded.options import EmbeddedOptions  # `engine.options` of engine.name embedded
from agl_trainer.engines.vllm.config import VLLMOptions  # `engine.options` of engine.name vllm

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


class BackendConfig(_Section):
    name: Annotated[Literal["torch", "verl"], _doc("training backend")] = "torch"
    lr: Annotated[float, _doc("learning rate", gt=0)] = 1e-3
    device: Annotated[str, _doc("torch device: auto, cpu, cuda or cuda:N")] = "auto"
    algorithm: AlgorithmSettings = msgspec.field(default_factory=AlgorithmSettings)  # AlgorithmConfig checks it
    options: TrainingOptions = msgspec.field(default_factory=TrainingOptions)  # both backends take it as it is
    verl: VerlSettings = msgspec.field(default_factory=VerlSettings)  # the verl backend takes it as it is
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)  # the backends take it as it is


class EngineConfig(_Section, tag_field="name"):
    """The `engine` section: its keys, and `options` typed by `engine.name` (the section is the member of
    `EngineSection` that name tags; a config without a name is embedded's, see config.validate)."""

    replicas: Annotated[int, _doc("engine servers (vllm)", ge=1)] = 1
    max_batch: Annotated[int, _doc("largest batch of concurrent requests the engine generates together", ge=1)] = 256


class EmbeddedEngineSection(EngineConfig, tag="embedded"):
    name: ClassVar[Literal["embedded"]] = "embedded"
    options: EmbeddedOptions = msgspec.field(default_factory=EmbeddedOptions)  # the engine takes it as it is


class VLLMEngineSection(EngineConfig, tag="vllm"):
    name: ClassVar[Literal["vllm"]] = "vllm"
    options: VLLMOptions = msgspec.field(default_factory=VLLMOptions)  # the engine takes it as it is


EngineSection = EmbeddedEngineSection | VLLMEngineSection
ENGINES = ("embedded", "vllm")  # engine.name's choices, in the order --help lists their options


GREEDY_BELOW = 1e-5  # sampling temperatures below this sample greedily, as vLLM does (the embedded engine too)


class SamplingConfig(_Section):
    temperature: Annotated[float, _doc("sampling temperature", ge=0)] = 1.0
    top_p: Annotated[float, _doc("nucleus sampling", gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, _doc("cap on generated tokens per call (0: the harness decides)", ge=0)] = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
        bool | Literal["auto"],
        _doc("bearer token on /v1/traces and /v1/logs (true/false; auto: on when not on loopback)"),
    ] = "auto"
    token_env: Annotated[
        str | None, _doc("environment variable holding the receiver's token (default AGL_RECEIVER_TOKEN, else generated)")
    ] = None


class OfflineConfig(_Section):
    """`agl train CONFIG --from-store traces.db`: train on rollouts collected earlier."""

    policy_version: Annotated[
        int,
        _doc("the policy version the store's calls give model.path's weights (what the engine serving them "
             "reported); the weights trained are this plus the steps taken. Staleness and its bound (loop.staleness) "
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
    staleness: Annotated[
        Annotated[int, msgspec.Meta(ge=-1)] | None,
        _doc(
            "most policy versions a trained token may lag behind the weights trained (-1: no bound, "
            "--from-store only; unset: 1 live, no bound from a store); algorithms/token_age.py"
        ),
    ] = None
    stale_policy: Annotated[
        Literal["wait", "drop", "mask"],
        _doc(
            "a rollout about to exceed the staleness bound: wait for it before updating, drop it, or mask "
            "(it runs on across updates; its tokens older than the bound get no loss, the rest train)"
        ),
    ] = "wait"
    max_span: Annotated[
        int,
        _doc(
            "stale_policy=mask: a rollout still running at its max_span-th update since its launch is "
            "dropped there (its harness killed); the loop launches up to max_span batches ahead",
            ge=1,
        ),
    ] = 4
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
    oldest_first: Annotated[
        bool,
        _doc(
            "a step trains the complete groups launched earliest (long rollouts first: they are the nearest "
            "to the staleness bound); false: those that completed first"
        ),
    ] = True
    generate_during_training: Annotated[
        bool,
        _doc(
            "switch=keep: rollouts keep generating under the current weights while the trainer trains; "
            "generation pauses only for the weight load (for an engine on other devices than the trainer)"
        ),
    ] = False
    completion_grace_s: Annotated[float, _doc("after a harness exits, wait this long for late spans", ge=0)] = 2.0
    failed_rollouts: Annotated[
        Literal["drop", "zero"], _doc("failed rollouts (harness error, timeout): drop them or train with reward 0")
    ] = "drop"
    skip_flat_groups: Annotated[
        bool,
        _doc(
            "a complete group whose rollouts all got the same reward (every advantage 0: nothing to learn) is set "
            "aside, recorded as dropped, and another group takes its place in the batch (DAPO's dynamic sampling)"
        ),
    ] = False
    flat_skip_limit: Annotated[
        int,
        _doc(
            "skip_flat_groups: a step sets aside at most this many batches' worth of flat groups; past it, flat "
            "groups train as they come (a task set the policy always or never solves would never fill a batch; "
            "0: no limit)",
            ge=0,
        ),
    ] = 4
    revisit_mixed: Annotated[
        int,
        _doc(
            "a task whose trained group got mixed rewards (some rollouts better than others: the groups that "
            "carry a signal) is drawn again, ahead of fresh tasks, up to this many more times in the run (a "
            "curriculum at the edge of what the policy can do; live runs; 0: every task once an epoch)",
            ge=0,
        ),
    ] = 0
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
    generate: Annotated[
        int,
        _doc("tokens the cached-prefix and fresh probes generate (the first reads the prefix's KV: one "
             "engine step, the canary's cost kept under 2% of a step)", ge=1, le=256),
    ] = 1


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
    engine: Annotated[
        EngineSection,
        _doc("inference engine (its engine.options: those marked with its name)"),
    ] = msgspec.field(default_factory=EmbeddedEngineSection)
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


def harness_argv(value: list[str] | str) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)
