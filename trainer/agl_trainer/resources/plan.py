"""Memory per GPU for a config, before anything starts: does the run fit, and if not, what to change.

    plan = plan_resources(config, gpu_memory_gib=80)
    print(format_plan(plan))          # the arithmetic, line by line
    plan.fits, plan.fixes             # verdict and the suggested changes

Collocated RL has two phases on each GPU, and both must fit:

- generating: the engine holds gpu_memory_utilization x GPU memory (weights, KV cache, its
  activations); the trainer keeps what is not offloaded (FSDP-sharded parameters and gradients
  unless backend.verl.param_offload, AdamW state unless optimizer_offload).
- training: sharded parameters + gradients, then either the micro-batch's activations (forward and
  backward) or the AdamW state (optimizer step); the engine keeps its memory unless it sleeps
  (engine.options.collocated: vLLM's sleep mode frees weights and KV cache while training).

Numbers: FSDP shards parameters, gradients and AdamW state (two moments) evenly over
nnodes x n_gpus_per_node ranks, in the master dtype (backend.options.param_dtype, float32 by
default, or the verl override fsdp_config.model_dtype). Activations are an estimate: bf16 layer tensors
(6 x hidden + 4 x intermediate per token and layer; with gradient checkpointing only the layer
inputs plus one layer), fp32 logits and their gradient, for backend.options.micro_batch_tokens
tokens (divided by Ulysses sequence parallelism). The engine's KV cache is what is left of its
budget after its weights (bf16, split by tensor parallelism) and a reserve for its activations.

The torch backend (one process, nothing offloaded) keeps AdamW's state through forward and backward,
gives a sample longer than micro_batch_tokens a micro-batch of its own (so the activations are
counted for max(micro_batch_tokens, engine.options.max_model_len) tokens) and keeps a KL reference
model (kl_coef > 0, full training). It hands its caching allocator's blocks back to CUDA after each
export for the engine, before the engine wakes (TorchBackend._hand_back_cached_memory): while vLLM
generates, the trainer holds its state, not its training peak.

LoRA (backend.lora.rank > 0, resources/lora.py): the base is frozen in the master dtype
(backend.options.param_dtype; bfloat16 is the choice for LoRA), once: the KL reference is the base
with the adapters off. The adapters (rank x (in + out) per adapted linear layer), their gradients
and AdamW's two moments are float32 (peft keeps adapters float32 over a bf16 base). vLLM loads its
own copy of the base in its own process: trainer and engine never share it (collocated, vLLM moves
its copy to CPU memory while it sleeps). An engine that takes adapters (resources/settings.py
engine_takes_adapters) gets the adapter alone each step, and vLLM reserves LoRA buffers at the
adapter's rank for every linear layer and the output head; otherwise the trainer merges, after
training with the engine asleep: lora.merged_state_dict merges one adapted weight at a time on the GPU
(its float32 update, the base's float32 copy and their sum), the merged weights going to CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_trainer.config import Config
from agl_trainer.engines.vllm.config import VLLMOptions
from agl_trainer.resources.architecture import (
    Architecture,
    dtype_bytes,
    read_architecture,
    safetensors_parameters,
)
from agl_trainer.resources.lora import adapted_layers, linear_layers, short_names

GIB = 1024**3
CUDA_CONTEXT_GIB = 1.0  # per process on a GPU: CUDA context, NCCL buffers, allocator slack
ENGINE_RESERVE_GIB = 1.5  # vLLM's activation peak (profiled at start) and CUDA graphs
VLLM_DEFAULT_UTILIZATION = 0.9
MAX_GPUS_SEARCHED = 4096
GPUS_PER_NODE = 8  # the usual node; more GPUs on one node come before more nodes
ADAPTER_BYTES = 4  # peft keeps adapters (and so their gradients and AdamW state) float32


@dataclass(frozen=True)
class LoraPlan:
    rank: int
    alpha: float
    modules: tuple[str, ...]  # q_proj, k_proj, ... (the adapted linear layers' names)
    layers: int  # adapted linear layers in the model
    parameters: int  # the adapters': all that trains
    adapted_weights: int  # parameters of the base weights the adapters update
    largest_weight: int  # the largest adapted weight's parameters
    engine_takes_adapter: bool  # else the trainer merges and the engine gets full weights
    untied_head: int = 0  # an adapted tied lm_head: merged, a weight of its own (vocab x hidden) more

    @property
    def adapter_bytes(self) -> float:
        return float(self.parameters * ADAPTER_BYTES)


@dataclass(frozen=True)
class EnginePlan:
    name: str
    replicas: int
    tensor_parallel: int
    dtype_bytes: int
    utilization: float | None  # vLLM: fraction of GPU memory; None: embedded (in-process)
    max_model_len: int
    kv_bytes_per_token: int
    collocated: bool
    weights_bytes: float  # per GPU
    budget_bytes: float  # per GPU: what the engine claims (vLLM) or holds (embedded)
    kv_bytes: float  # per GPU, <= 0 when the weights leave no room
    # LoRA: vLLM's adapter buffers (rank x (in + out) of every linear layer and the head, in its dtype),
    # or the embedded engine's float32 copies of the adapted base weights (each adapter merges into those)
    adapter_bytes: float = 0.0
    # loop.switch: keep: calls frozen across an update hold the engine's KV cache, so vLLM cannot
    # sleep while the trainer trains, collocated or not (the loop skips the sleep)
    holds_frozen_calls: bool = False

    @property
    def asleep_while_training(self) -> bool:
        return self.name == "vllm" and self.collocated and not self.holds_frozen_calls

    @property
    def gpus(self) -> int:
        return self.replicas * self.tensor_parallel

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_bytes // self.kv_bytes_per_token)) if self.kv_bytes_per_token else 0


@dataclass(frozen=True)
class TrainerPlan:
    backend: str
    world_size: int
    nnodes: int
    gpus_per_node: int
    param_bytes: int  # per parameter, master dtype
    params_bytes: float  # per GPU, sharded
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    gathered_bytes: float  # FSDP: unsharded layers in flight (current + prefetched)
    micro_batch_tokens: int
    param_offload: bool
    optimizer_offload: bool
    gradient_checkpointing: bool
    sequence_parallel: int
    trainable_parameters: int = 0
    # weights that do not train, always on the GPU: the LoRA base, or full training's KL reference model
    frozen_bytes: float = 0.0
    reference_model: bool = False  # frozen_bytes is a second model (kl_coef > 0 without LoRA)
    longest_sample: int = 0  # engine.options.max_model_len: such a sample is one micro-batch
    sync_bytes: float = 0.0  # held on top while the trainer merges for an engine that takes no adapter
    lora: LoraPlan | None = None

    @property
    def resident_bytes(self) -> float:
        """Held on the GPU while the engine generates."""
        kept = self.frozen_bytes + (0.0 if self.param_offload else self.params_bytes + self.grads_bytes)
        kept += 0.0 if self.optimizer_offload else self.optimizer_bytes
        return kept

    @property
    def training_peak_bytes(self) -> float:
        base = self.frozen_bytes + self.params_bytes + self.grads_bytes
        if self.backend == "torch":  # nothing offloaded: AdamW's state stays through forward and backward
            return base + self.optimizer_bytes + self.activation_bytes
        return base + max(self.activation_bytes + self.gathered_bytes, self.optimizer_bytes)

    @property
    def sync_peak_bytes(self) -> float:
        """While the trainer hands over weights (after the step: no activations; the gradients stay)."""
        state = self.frozen_bytes + self.params_bytes + self.grads_bytes + self.optimizer_bytes
        return state + self.sync_bytes if self.sync_bytes else 0.0


@dataclass
class ResourcePlan:
    model_path: str
    architecture: Architecture
    parameters: int
    parameters_source: str  # "safetensors" or "config.json"
    has_weights: bool
    trainer: TrainerPlan
    engine: EnginePlan
    gpu_memory_gib: float
    generating_bytes: float = 0.0
    training_bytes: float = 0.0
    syncing_bytes: float = 0.0  # LoRA merged for an engine that takes no adapter; 0 otherwise
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak_bytes(self) -> float:
        return max(self.generating_bytes, self.training_bytes, self.syncing_bytes)


def plan_resources(
    config: Config,
    gpu_memory_gib: float = 80.0,
    *,
    base: Path | None = None,
    takes_adapters: bool | None = None,
) -> ResourcePlan:
    """The per-GPU arithmetic for `config` on GPUs of `gpu_memory_gib` (see the module docstring).
    `takes_adapters`: whether the engine gets a LoRA run's adapter alone (default: as the run's engine
    answers, resources/settings.py)."""
    if gpu_memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be positive, got {gpu_memory_gib}")
    assert config.model.path is not None, "load_config checks model.path"
    model_dir = Path(config.model.path)
    if base is not None and not model_dir.is_absolute() and not model_dir.exists():
        model_dir = base / model_dir
    arch = read_architecture(model_dir)
    stored = safetensors_parameters(model_dir)
    parameters = stored if stored is not None else arch.parameters
    if takes_adapters is None:
        from agl_trainer.resources.settings import engine_takes_adapters

        takes_adapters = engine_takes_adapters(config)
    plan = _plan(config, arch, parameters, gpu_memory_gib, takes_adapters)
    plan.model_path = str(config.model.path)
    plan.parameters_source = "safetensors" if stored is not None else "config.json"
    plan.has_weights = stored is not None or any(model_dir.glob("*.bin"))
    if not plan.has_weights:
        plan.notes.append(
            f"{config.model.path} holds no weights (only the architecture): the run itself needs the "
            "model's safetensors there (set model.path to the downloaded model directory)"
        )
    if not arch.known_layout and stored is None:
        plan.notes.append(
            f"model_type {arch.model_type!r}: counted with the Llama-style layout (no safetensors to read)"
        )
    plan.fixes += _suggest_scale(config, arch, parameters, gpu_memory_gib, plan)
    return plan


def _plan(
    config: Config, arch: Architecture, parameters: int, gpu_memory_gib: float, takes_adapters: bool = False
) -> ResourcePlan:
    trainer = _trainer_plan(config, arch, parameters, takes_adapters)
    engine = _engine_plan(config, arch, parameters, gpu_memory_gib, trainer.lora)
    plan = ResourcePlan(
        model_path="", architecture=arch, parameters=parameters, parameters_source="", has_weights=False,
        trainer=trainer, engine=engine, gpu_memory_gib=gpu_memory_gib,
    )  # fmt: skip
    _check(plan, config)
    return plan


def _lora_plan(config: Config, arch: Architecture, takes_adapters: bool) -> LoraPlan:
    lora = config.backend.lora
    layers = adapted_layers(arch, tuple(lora.target_modules))  # a tuple once read: LoraConfig splits a string
    tied_head = arch.tie_word_embeddings and any(layer.name == "lm_head" for layer in layers)
    return LoraPlan(
        rank=lora.rank, alpha=lora.alpha, modules=tuple(short_names(layers)), layers=len(layers),
        parameters=sum(layer.adapter_parameters(lora.rank) for layer in layers),
        adapted_weights=sum(layer.weight_parameters for layer in layers),
        largest_weight=max(layer.weight_parameters for layer in layers),
        engine_takes_adapter=takes_adapters,
        untied_head=arch.embedding_parameters if tied_head else 0,
    )  # fmt: skip


def _trainer_plan(
    config: Config, arch: Architecture, parameters: int, takes_adapters: bool = False
) -> TrainerPlan:
    backend, verl, options = config.backend, config.backend.verl, config.backend.options
    if backend.name == "verl":
        world, nnodes, per_node = verl.nnodes * verl.n_gpus_per_node, verl.nnodes, verl.n_gpus_per_node
        master = (
            _override(verl.override, "fsdp_config.model_dtype")
            or _override(verl.override, "engine.model_dtype")
            or options.param_dtype
        )
        param_offload, optimizer_offload = verl.param_offload, verl.optimizer_offload
        checkpointing, sp = verl.gradient_checkpointing, verl.ulysses_sequence_parallel_size
    else:  # the torch backend: one process, nothing sharded or offloaded
        world, nnodes, per_node = 1, 1, 1
        master = options.param_dtype
        param_offload = optimizer_offload = False
        checkpointing, sp = options.gradient_checkpointing, 1
    param_bytes = dtype_bytes(master, 4)
    tokens = options.micro_batch_tokens
    longest = (config.engine.options.max_model_len or 0) if backend.name == "torch" else 0
    local_tokens = max(1, max(tokens, longest) // sp)
    layer_tensors = 6 * arch.hidden_size + 4 * arch.intermediate_size  # bf16 elements kept per token
    if checkpointing:
        per_token = 2 * (arch.num_hidden_layers * arch.hidden_size + layer_tensors)
    else:
        per_token = 2 * arch.num_hidden_layers * layer_tensors
    logits = 8 * arch.vocab_size  # fp32 logits and their gradient
    activations = float(local_tokens * (per_token + logits))
    gathered = 2 * 2.0 * arch.layer_parameters if world > 1 else 0.0  # bf16, current + prefetched layer
    torch_backend = backend.name == "torch"
    lora = _lora_plan(config, arch, takes_adapters) if torch_backend and backend.lora.rank > 0 else None
    if lora is not None:  # the adapters train, float32; the base is frozen in the master dtype, once
        adapter = lora.adapter_bytes
        # merged_state_dict, one weight at a time: the largest one's float32 update, base copy and sum
        merging = 0.0 if lora.engine_takes_adapter else 3 * 4.0 * lora.largest_weight
        return TrainerPlan(
            backend=backend.name, world_size=1, nnodes=1, gpus_per_node=1, param_bytes=param_bytes,
            params_bytes=adapter, grads_bytes=adapter, optimizer_bytes=2 * adapter,
            activation_bytes=activations, gathered_bytes=0.0, micro_batch_tokens=tokens,
            param_offload=False, optimizer_offload=False, gradient_checkpointing=checkpointing,
            sequence_parallel=1, trainable_parameters=lora.parameters,
            frozen_bytes=float(parameters * param_bytes), longest_sample=longest, sync_bytes=merging,
            lora=lora,
        )  # fmt: skip
    reference = torch_backend and config.backend.algorithm.kl_coef > 0
    return TrainerPlan(
        backend=backend.name, world_size=world, nnodes=nnodes, gpus_per_node=per_node,
        param_bytes=param_bytes,
        params_bytes=parameters * param_bytes / world,
        grads_bytes=parameters * param_bytes / world,
        optimizer_bytes=2 * parameters * param_bytes / world,
        activation_bytes=activations, gathered_bytes=gathered, micro_batch_tokens=tokens,
        param_offload=param_offload, optimizer_offload=optimizer_offload,
        gradient_checkpointing=checkpointing, sequence_parallel=sp,
        trainable_parameters=parameters, frozen_bytes=float(parameters * param_bytes) if reference else 0.0,
        reference_model=reference, longest_sample=longest,
    )  # fmt: skip


def _engine_plan(
    config: Config, arch: Architecture, parameters: int, gpu_memory_gib: float, lora: LoraPlan | None = None
) -> EnginePlan:
    options = config.engine.options
    gpu = gpu_memory_gib * GIB
    max_len = options.max_model_len or arch.max_position_embeddings or 4096
    if isinstance(options, VLLMOptions):
        extra = options.extra_args
        tp = int(_flag(extra, "--tensor-parallel-size", "-tp") or 1)
        kv_dtype = _flag(extra, "--kv-cache-dtype")
        weight_bytes = dtype_bytes(None if options.dtype == "auto" else options.dtype, 2)
        kv_bytes = dtype_bytes(None if kv_dtype in (None, "auto") else kv_dtype, weight_bytes)
        utilization = options.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
        weights = parameters * weight_bytes / tp
        budget = utilization * gpu
        slots = 0.0
        if lora is not None and lora.engine_takes_adapter:  # --enable-lora --max-loras 1: every linear
            # layer, the output head's too (vLLM wraps it whatever the adapter targets)
            every = linear_layers(arch)
            slots = sum(layer.adapter_parameters(lora.rank) for layer in every) * weight_bytes / tp
        return EnginePlan(
            name="vllm", replicas=config.engine.replicas, tensor_parallel=tp, dtype_bytes=weight_bytes,
            utilization=utilization, max_model_len=max_len,
            kv_bytes_per_token=arch.kv_bytes_per_token(kv_bytes), collocated=options.collocated,
            weights_bytes=weights, budget_bytes=budget,
            kv_bytes=budget - weights - slots - ENGINE_RESERVE_GIB * GIB,
            holds_frozen_calls=config.loop.switch == "keep", adapter_bytes=slots,
        )  # fmt: skip
    # The embedded engine keeps its own fp32 copy of the weights in the trainer's process; its KV
    # cache grows with the batch (engine.max_batch), not from a preallocated budget.
    weights = parameters * 4.0
    # AdapterMerger's base copies, and an adapted tied head's weight of its own (it unties the head)
    pristine = 4.0 * (lora.adapted_weights + lora.untied_head) if lora is not None else 0.0
    return EnginePlan(
        name="embedded", replicas=1, tensor_parallel=1, dtype_bytes=4, utilization=None, max_model_len=max_len,
        kv_bytes_per_token=arch.kv_bytes_per_token(4), collocated=False,
        weights_bytes=weights, budget_bytes=weights + pristine, kv_bytes=0.0, adapter_bytes=pristine,
    )  # fmt: skip


def _check(plan: ResourcePlan, config: Config) -> None:
    trainer, engine, gpu = plan.trainer, plan.engine, plan.gpu_memory_gib * GIB
    context = CUDA_CONTEXT_GIB * GIB * (2 if engine.name == "vllm" else 1)
    plan.generating_bytes = engine.budget_bytes + trainer.resident_bytes + context
    engine_while_training = engine.budget_bytes
    if engine.asleep_while_training:
        engine_while_training = 0.0  # asleep: level 1 moves weights to CPU, drops the KV cache
    plan.training_bytes = trainer.training_peak_bytes + engine_while_training + context
    if trainer.sync_bytes:  # after training, before update_weights wakes the engine
        plan.syncing_bytes = trainer.sync_peak_bytes + engine_while_training + context
    if trainer.lora is not None and trainer.param_bytes > 2:
        plan.fixes.append(
            f"set backend.options.param_dtype: bfloat16 (the frozen base in {trainer.param_bytes * 8}-bit "
            "gains nothing; the adapters stay float32)"
        )
    if engine.name == "vllm":
        if trainer.backend == "verl" and engine.gpus > trainer.world_size:
            plan.notes.append(
                f"engine: {engine.replicas} replica(s) x TP {engine.tensor_parallel} = {engine.gpus} GPUs, more than "
                f"the {trainer.world_size} training GPUs; the extra replicas need GPUs of their own"
            )
        need = engine.max_model_len * engine.kv_bytes_per_token
        if engine.kv_bytes < need:
            plan.problems.append(
                f"engine: the KV cache gets {_gib(max(engine.kv_bytes, 0))} per GPU but one sequence of max_model_len "
                f"{engine.max_model_len} needs {_gib(need)} (vLLM refuses to start)"
            )
            plan.fixes.append(
                "raise engine.options.gpu_memory_utilization, lower engine.options.max_model_len, "
                "or split the model with tensor parallelism (engine.options.extra_args: [--tensor-parallel-size, 2])"
            )
    if plan.generating_bytes > gpu:
        plan.problems.append(
            f"while generating: {_gib(plan.generating_bytes)} per GPU > {plan.gpu_memory_gib:g} GiB"
        )
        if trainer.backend == "verl" and not (trainer.param_offload and trainer.optimizer_offload):
            plan.fixes.append(
                "set backend.verl.param_offload: true and backend.verl.optimizer_offload: true "
                "(the trainer's state leaves the GPU while vLLM generates)"
            )
        if engine.utilization is not None:
            room = (gpu - trainer.resident_bytes - context) / gpu
            if room > 0.05:
                plan.fixes.append(f"lower engine.options.gpu_memory_utilization to {int(room * 100) / 100:.2f} or less")
    if plan.training_bytes > gpu:
        plan.problems.append(f"while training: {_gib(plan.training_bytes)} per GPU > {plan.gpu_memory_gib:g} GiB")
        if engine.name == "vllm" and engine.holds_frozen_calls:
            plan.fixes.append(
                "set loop.switch: drain (with keep, the calls frozen across an update hold vLLM's weights and "
                "KV cache on the GPU while the trainer trains: it cannot sleep)"
            )
        elif engine.name == "vllm" and not engine.collocated:
            plan.fixes.append("set engine.options.collocated: true (vLLM sleeps while the trainer trains)")
        if trainer.activation_bytes > trainer.optimizer_bytes:
            if not trainer.gradient_checkpointing:
                key = "backend.verl.gradient_checkpointing" if trainer.backend == "verl" else "backend.options.gradient_checkpointing"
                plan.fixes.append(f"set {key}: true (recompute activations in backward)")
            if trainer.longest_sample > trainer.micro_batch_tokens:
                plan.fixes.append(
                    f"lower engine.options.max_model_len (now {trainer.longest_sample}: a sample that long "
                    f"is a micro-batch of its own, activations {_gib(trainer.activation_bytes)} per GPU)"
                )
            else:
                plan.fixes.append(
                    f"lower backend.options.micro_batch_tokens (now {trainer.micro_batch_tokens}: "
                    f"activations {_gib(trainer.activation_bytes)} per GPU)"
                )
        if trainer.backend == "torch" and trainer.lora is None:
            plan.fixes.append("use backend.name: verl to shard the model over several GPUs (FSDP2)")
    if plan.syncing_bytes > gpu:
        plan.problems.append(
            f"while merging the adapter for the engine: {_gib(plan.syncing_bytes)} per GPU > "
            f"{plan.gpu_memory_gib:g} GiB"
        )
        plan.fixes.append(
            "adapt fewer layers (backend.lora.target_modules), or an engine that takes the adapter alone"
        )


def _suggest_scale(
    config: Config, arch: Architecture, parameters: int, gpu_memory_gib: float, plan: ResourcePlan
) -> list[str]:
    """The fewest GPUs on which this config fits, for verl: more GPUs on the one node (up to 8),
    then more nodes of the configured size."""
    if plan.fits or config.backend.name != "verl":
        return []
    verl = config.backend.verl
    layouts = [(1, n) for n in range(verl.n_gpus_per_node + 1, GPUS_PER_NODE + 1)] if verl.nnodes == 1 else []
    layouts += [(nodes, verl.n_gpus_per_node) for nodes in range(verl.nnodes + 1, MAX_GPUS_SEARCHED // verl.n_gpus_per_node + 1)]
    for nodes, per_node in layouts:
        if _plan(_with_layout(config, nodes, per_node), arch, parameters, gpu_memory_gib).fits:
            return [
                f"more GPUs: backend.verl.nnodes: {nodes}, backend.verl.n_gpus_per_node: {per_node} "
                f"({nodes * per_node} GPUs) fits as configured otherwise"
            ]
    return []


def _with_layout(config: Config, nodes: int, per_node: int) -> Config:
    import msgspec

    verl = msgspec.structs.replace(config.backend.verl, nnodes=nodes, n_gpus_per_node=per_node)
    return msgspec.structs.replace(config, backend=msgspec.structs.replace(config.backend, verl=verl))


def _override(override: dict[str, Any], dotted: str) -> str | None:
    """A verl actor key from backend.verl.override, given nested or dotted."""
    if dotted in override:
        return str(override[dotted])
    node: Any = override
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return str(node)


def _flag(args: list[str], *names: str) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def format_plan(plan: ResourcePlan) -> str:
    arch, trainer, engine = plan.architecture, plan.trainer, plan.engine
    gpu = plan.gpu_memory_gib
    b = f"{plan.parameters / 1e9:.2f} B" if plan.parameters >= 1e8 else f"{plan.parameters / 1e6:.2f} M"
    lines = [
        f"model: {plan.model_path} ({arch.model_type}, {b} parameters from {plan.parameters_source}; "
        f"{arch.num_hidden_layers} layers, hidden {arch.hidden_size}, heads {arch.num_attention_heads}/"
        f"{arch.num_key_value_heads} kv x {arch.head_dim}, vocab {arch.vocab_size}, "
        f"{'tied' if arch.tie_word_embeddings else 'untied'} embeddings)",
    ]
    if trainer.backend == "verl":
        lines.append(
            f"training: verl FSDP2 over {trainer.world_size} GPUs ({trainer.nnodes} node(s) x {trainer.gpus_per_node}), "
            f"master weights {trainer.param_bytes * 8}-bit, AdamW; offload params {_yes(trainer.param_offload)}, "
            f"optimizer {_yes(trainer.optimizer_offload)}; gradient checkpointing {_yes(trainer.gradient_checkpointing)}"
            + (f"; Ulysses SP {trainer.sequence_parallel}" if trainer.sequence_parallel > 1 else "")
        )
    elif trainer.lora is not None:
        lines += _lora_lines(plan, trainer.lora)
    else:
        lines.append(f"training: torch backend, one device, master weights {trainer.param_bytes * 8}-bit, AdamW")
    if trainer.lora is None:
        lines.append(
            f"  per GPU: weights {_gib(trainer.params_bytes)}, gradients {_gib(trainer.grads_bytes)}, "
            f"AdamW {_gib(trainer.optimizer_bytes)}, activations ~{_gib(trainer.activation_bytes)} "
            f"({_micro_batch(trainer)})"
            + (f", gathered layers {_gib(trainer.gathered_bytes)}" if trainer.gathered_bytes else "")
            + (f", KL reference model {_gib(trainer.frozen_bytes)}" if trainer.reference_model else "")
        )
    kv_token = f"{engine.kv_bytes_per_token / 1024:.0f} KiB/token"
    if engine.name == "vllm":
        lines.append(
            f"engine: vLLM, {engine.replicas} replica(s) x TP {engine.tensor_parallel}, weights "
            f"{engine.dtype_bytes * 8}-bit, gpu_memory_utilization {engine.utilization:g} ({_gib(engine.budget_bytes)}), "
            f"max_model_len {engine.max_model_len}, {_while_training(engine)}"
        )
        sequences = engine.kv_tokens // engine.max_model_len
        slots = f", LoRA buffers {_gib(engine.adapter_bytes)}" if engine.adapter_bytes else ""
        lines.append(
            f"  per GPU: weights {_gib(engine.weights_bytes)}{slots}, "
            f"KV cache {_gib(max(engine.kv_bytes, 0))} = {engine.kv_tokens:,} tokens at {kv_token} "
            f"({sequences} sequence(s) of max_model_len)"
        )
        if trainer.lora is not None:
            asleep = "one while training (vLLM sleeps, its copy in CPU memory)"
            lines.append(
                "  base: vLLM's process loads its own copy, not shared with the trainer's: two on the GPU "
                f"while generating, {asleep if engine.asleep_while_training else 'two while training'}"
            )
    else:
        copies = _gib(engine.adapter_bytes)
        pristine = f", copies of the adapted weights {copies}" if engine.adapter_bytes else ""
        lines.append(
            f"engine: embedded (in the trainer's process), fp32 weights {_gib(engine.weights_bytes)}"
            f"{pristine}; KV cache grows with the batch at {kv_token}"
        )
    syncing = f", merging {_gib(plan.syncing_bytes)}" if plan.syncing_bytes else ""
    lines.append(
        f"per GPU of {gpu:g} GiB: generating {_gib(plan.generating_bytes)}, "
        f"training {_gib(plan.training_bytes)}{syncing} "
        f"(incl. {CUDA_CONTEXT_GIB:g} GiB CUDA context per process)"
    )
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.fits:
        lines.append(f"fits: peak {_gib(plan.peak_bytes)} of {gpu:g} GiB per GPU")
    else:
        lines.append(f"does not fit on {gpu:g} GiB GPUs:")
        lines += [f"  - {problem}" for problem in plan.problems]
        lines += [f"  fix: {fix}" for fix in dict.fromkeys(plan.fixes)]
    return "\n".join(lines)


def _lora_lines(plan: ResourcePlan, lora: LoraPlan) -> list[str]:
    trainer = plan.trainer
    share = 100.0 * lora.parameters / plan.parameters
    if lora.engine_takes_adapter:
        sync = f"the adapter alone, {lora.adapter_bytes / 1024**2:.0f} MiB a step (the engine loads adapters)"
    else:
        weight_bytes = plan.engine.dtype_bytes if plan.engine.name == "vllm" else 4
        merged = (plan.parameters + lora.untied_head) * weight_bytes  # an adapted tied head: untied
        sync = (
            f"the merged weights, {_gib(merged)} a step (the engine takes no adapter); merging holds one "
            f"adapted weight's float32 update, base copy and sum on the GPU at a time, {_gib(trainer.sync_bytes)}"
        )
    return [
        f"training: torch backend, one device, LoRA rank {lora.rank} (alpha {lora.alpha:g}) on "
        f"{', '.join(lora.modules)}: {lora.layers} linear layers, {lora.parameters / 1e6:.2f} M trainable "
        f"parameters ({share:.2f}% of the model), AdamW on the adapters only",
        f"  per GPU: frozen base {_gib(trainer.frozen_bytes)} ({trainer.param_bytes * 8}-bit, once: the KL "
        f"reference is the base, adapters off), adapters {_gib(trainer.params_bytes)} (32-bit), gradients "
        f"{_gib(trainer.grads_bytes)}, AdamW {_gib(trainer.optimizer_bytes)}, activations "
        f"~{_gib(trainer.activation_bytes)} ({_micro_batch(trainer)})",
        f"  sync: {sync}",
    ]


def _micro_batch(trainer: TrainerPlan) -> str:
    if trainer.longest_sample > trainer.micro_batch_tokens:
        return (
            f"{trainer.longest_sample} tokens: a sample up to max_model_len gets a micro-batch of its own, "
            f"micro_batch_tokens is {trainer.micro_batch_tokens}"
        )
    return f"{trainer.micro_batch_tokens} tokens a micro-batch"


def _while_training(engine: EnginePlan) -> str:
    if engine.asleep_while_training:
        return "sleeps while training"
    if engine.holds_frozen_calls:
        return "stays resident while training (loop.switch: keep: frozen calls keep their KV cache)"
    return "stays resident while training"


def _yes(flag: bool) -> str:
    return "on" if flag else "off"
