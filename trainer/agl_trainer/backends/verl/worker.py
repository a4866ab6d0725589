"""The Ray worker: verl's `TrainingWorker` (one FSDP2 engine per rank) with agl's loss and a few
agl-shaped calls. Imported in the Ray worker processes (and by the driver only to name the class).

Each call takes per-rank payloads built by the driver (`payload.py`), so the driver decides which
rows each data-parallel rank gets; the worker turns a payload into verl's no-padding TensorDict,
runs the engine, and answers with plain tensors and floats.

The loss (`_agl_loss`) is agl's `rl_objective` on the trained positions of each micro-batch, with
the per-token weights the driver computed over the whole mini-batch, times the data-parallel size:
FSDP averages gradients over ranks, and the weights already sum the whole mini-batch, so the
average of dp_size * (this rank's share) is exactly the mini-batch's gradient.

Training micro-batches skip verl's output step (`_forward_trained_positions`): verl takes logits,
log-probs and entropy at every position, but only the trained positions (weight != 0, about a
quarter of an agent's tokens) enter the loss, so the output head sees only their hidden states, as
the torch backend does (`head_sees_only`). Both of verl's input layouts take this path: packed
(`use_remove_padding`, flash-attn on GPUs: hidden states [1, total, H]) and padded (CPU, sdpa:
[rows, longest, H]). Ulysses sequence parallelism (hidden states sharded across ranks), the
reference model and `agl_logprobs` keep verl's own forward.

With `lora` set, verl's engine is told it trains LoRA (so it builds the optimizer over a peft model and
checkpoints the adapter alone), but the adapter is agl's (`backends/lora.py`, as the torch backend's,
drawn from the run's seed), placed between loading the model and sharding it. The KL reference is the
same model with the adapter switched off (peft's `disable_adapter`): no second model is loaded.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

import msgspec
import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.utils.distributed import initialize_global_process_group_ray
from verl.workers.engine_workers import TrainingWorker

from agl_trainer.algorithms import AlgorithmConfig, token_logprobs
from agl_trainer.backends import lora, varlen_attention
from agl_trainer.backends.chunked_logprobs import token_outputs
from agl_trainer.backends.hf_model import head_sees_only, supports_packing
from agl_trainer.backends.microbatch_loss import KeptTokens, micro_batch_loss
from agl_trainer.backends.schedule import LRLambda, schedule_may_lead
from agl_trainer.backends.settings import VerlSettings
from agl_trainer.backends.torch_config import LoraConfig, TorchBackendConfig
from agl_trainer.backends.weight_buckets import BucketWriter
from agl_trainer.weights.update import AdapterState

# payload fields aligned to logit positions: value t belongs to the token at t + 1
SHIFTED_FIELDS = (
    "weights", "advantages", "engine_logprobs", "versions", "old_logprobs", "known", "switched", "before_logprobs"
)


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker needs (it crosses Ray, pickled): the backend's typed settings as they are, and
    what the driver resolved for the workers' device. Unpickling a Struct runs its checks again (cheap,
    and on the settings' own values: no Ray address or CUDA probe)."""

    training: TorchBackendConfig  # backend.options, lr, seed, the model's path, backend.algorithm, backend.lora
    verl: VerlSettings  # backend.verl: offload, checkpointing, sequence parallelism, verl's overrides
    attn_implementation: str  # backend.options.attn_implementation, else the best this device has
    model_dtype: str  # master weights: fp32 | bf16
    compute_dtype: str  # FSDP mixed-precision param dtype: fp32 | bf16
    dist_backend: str | None  # "cpu:gloo" on the CPU platform; None lets verl choose (nccl on GPUs)
    model_override: dict[str, Any] = {}  # HF config keys (dropout off)

    @property
    def lora(self) -> LoraConfig | None:
        """Adapters over a frozen base; None: every weight trains."""
        return self.training.lora if self.training.lora.enabled else None

    @property
    def use_remove_padding(self) -> bool:  # verl's packed inputs: flash-attn's varlen kernels
        return self.attn_implementation == "flash_attention_2"

    @property
    def gradient_checkpointing(self) -> bool:
        return self.training.gradient_checkpointing or self.verl.gradient_checkpointing


def build_training_worker_config(settings: WorkerSettings):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

    from agl_trainer.backends.verl.overrides import apply_overrides

    model = HFModelConfig(
        path=str(settings.training.model_path),
        trust_remote_code=settings.training.trust_remote_code,
        load_tokenizer=False,  # the tokenizer would rewrite pad/eos ids in the model config; agl copies its files
        override_config={"attn_implementation": settings.attn_implementation, **settings.model_override},
        use_remove_padding=settings.use_remove_padding,
        enable_gradient_checkpointing=settings.gradient_checkpointing,
        # > 0: verl's engine builds and checkpoints a peft model (the adapter itself is agl's, see the worker)
        lora_rank=settings.lora.rank if settings.lora is not None else 0,
    )
    precision = {"param_dtype": settings.compute_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype=settings.model_dtype,
        mixed_precision=precision,
        param_offload=settings.verl.param_offload,
        optimizer_offload=settings.verl.optimizer_offload,
        ulysses_sequence_parallel_size=settings.verl.ulysses_sequence_parallel_size,
        use_torch_compile=False,  # compiling the entropy kernel costs more than it saves at agl's step sizes
        use_dynamic_bsz=True,
        use_remove_padding=settings.use_remove_padding,
        seed=settings.training.seed,
    )
    optim = FSDPOptimizerConfig(
        optimizer="AdamW",
        lr=settings.training.lr,
        betas=tuple(settings.training.betas),
        weight_decay=settings.training.weight_decay,
        clip_grad=float("inf") if settings.training.max_grad_norm is None else settings.training.max_grad_norm,
        override_optimizer_config={"eps": settings.training.eps},
        total_training_steps=settings.training.total_steps or 1,
    )
    checkpoint = CheckpointConfig(
        save_contents=["model", "optimizer", "extra"],
        load_contents=["model", "optimizer", "extra"],
        save_lora_only=settings.lora is not None,  # the base is model_path's: shards of the adapter only
    )
    apply_overrides(
        {"model": model, "engine": engine, "optim": optim, "checkpoint": checkpoint}, settings.verl.override
    )
    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=model,
        engine_config=engine,
        optimizer_config=optim,
        checkpoint_config=checkpoint,
    )


def _vectorised_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    return token_logprobs(logits, labels)


def use_vectorised_logprobs() -> bool:
    """Without flash-attn's cross-entropy kernel (CPU workers), verl's fallback takes one logsumexp
    per position in a Python loop (most of a small model's step); agl's token_logprobs is the same
    math in one call. Patched in verl's FSDP engine module of this worker process only."""
    from verl.utils import torch_functional
    from verl.workers.engine.fsdp import transformer_impl

    if (
        torch_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE
        or torch_functional.NPU_CROSS_ENTROPY_LOSS_AVAILABLE
    ):
        return False
    transformer_impl.logprobs_from_logits = _vectorised_logprobs
    return True


class AglTrainingWorker(TrainingWorker):
    def __init__(self, settings: WorkerSettings) -> None:
        if settings.dist_backend is not None:
            # verl would ask for "cpu:gloo,<device>:<backend>", which is "cpu:gloo,cpu:gloo" on a CPU
            initialize_global_process_group_ray(backend=settings.dist_backend)
            # Ray starts a worker with OMP_NUM_THREADS=1; a CPU worker owns its share of the node
            local = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
        torch.manual_seed(settings.training.seed)
        use_vectorised_logprobs()
        if settings.attn_implementation == varlen_attention.NAME:
            varlen_attention.register()  # in this worker process, before verl loads the model
        super().__init__(build_training_worker_config(settings))
        self.settings = settings
        if settings.lora is not None:  # verl's engine calls it between loading the model and sharding it
            self.engine._build_lora_module = self._with_adapter
        self._verl_forward_step = self.engine.forward_step
        self.packed = False  # rows hold several samples (agl_init probes the model)
        self._inputs_for_packed_rows(self.engine)
        if settings.verl.ulysses_sequence_parallel_size == 1:
            # forward_backward_batch calls self.forward_step: this engine instance takes agl's
            self.engine.forward_step = self._forward_trained_positions
        self.loss_fn = self._agl_loss
        self._sums: dict[str, float] = defaultdict(float)
        self._maxima: dict[str, float] = defaultdict(float)
        self._current_version: int | None = None  # the driver's, for the agl_train call under way
        self.ref_engine = None
        self._export_staging: list[torch.Tensor] = []  # pinned host buckets of agl_state_dict, reused

    # ---------------------------------------------------------------------------------- set-up
    def _with_adapter(self, module: torch.nn.Module) -> Any:
        """The torch backend's adapter (TorchBackend._with_adapters), on every rank from the same seed."""
        assert self.settings.lora is not None
        model = lora.wrap(module, self.settings.lora, seed=self.settings.training.seed)
        if self.settings.gradient_checkpointing:  # checkpointed blocks over a frozen base need an input grad
            model.enable_input_require_grads()
        return model

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_init(self) -> dict[str, Any]:
        """Build model, optimizer and agl's LR schedule (warmup + constant/linear/cosine, stepped
        once per optimizer step, as the torch backend does). Returns where this rank runs."""
        import ray

        self.engine.initialize()
        schedule = LRLambda(
            self.settings.training.warmup_steps,
            self.settings.training.total_steps,
            self.settings.training.lr_schedule,
            self.settings.training.min_lr_ratio,
        )
        for group in self.engine.optimizer.param_groups:
            group["lr"] = self.settings.training.lr
            group.pop("initial_lr", None)
        self.engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.engine.optimizer, schedule)
        self.engine.checkpoint_manager.lr_scheduler = self.engine.lr_scheduler
        if self.settings.training.algorithm.kl_coef > 0 and self.settings.lora is None:  # with LoRA: the base
            self.ref_engine = self._build_reference()
        self.packed = self._keeps_packed_samples_apart()
        return {
            "rank": torch.distributed.get_rank(),
            "dp_rank": self.engine.get_data_parallel_rank(),
            "dp_size": self.engine.get_data_parallel_size(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "vocab_size": int(self.engine.model_config.hf_config.vocab_size),
            "hidden_size": int(self.engine.module.get_input_embeddings().weight.shape[1]),
            "packed": self.packed,
            "adapter_config": lora.adapter_config(self.engine.module) if self.settings.lora else None,
        }

    def _keeps_packed_samples_apart(self) -> bool:
        """backend.packing, as the torch backend reads it: `auto` probes the sharded model (every rank
        runs the same forward) for samples packed in a row with position_ids restarting."""
        if self.settings.training.packing != "auto":
            return self.settings.training.packing == "packed"
        module = self.engine.module
        device = next(module.parameters()).device
        tolerance = 1e-3 if self.settings.compute_dtype == "fp32" else 5e-2
        return supports_packing(module, device, tolerance)

    def _inputs_for_packed_rows(self, engine) -> None:
        """The engine's model inputs, in the padded layout with packed rows, without verl's attention
        mask: transformers then keeps the samples of a row apart by their restarting position_ids (as
        in the torch backend's packed rows), where the mask would let them attend to each other. The
        packed layout (use_remove_padding) passes no mask already. Patched on this engine instance."""
        verl_prepare = engine.prepare_model_inputs

        def prepare_model_inputs(micro_batch):
            inputs, output_args = verl_prepare(micro_batch=micro_batch)
            if self.packed and inputs.get("attention_mask") is not None:
                inputs["attention_mask"] = None
            return inputs, output_args

        engine.prepare_model_inputs = prepare_model_inputs

    def _build_reference(self):
        """The frozen initial policy for the KL penalty: a second FSDP2 engine of the same model in
        this process, never stepped (AdamW allocates its state at the first step, so it costs the
        weights only). Not verl's forward_only engine: that one pins CPU memory, which needs CUDA."""
        import copy

        from verl.workers.engine import EngineRegistry

        engine = EngineRegistry.new(
            model_type=self.config.model_type,
            backend=self.engine_config.strategy,
            model_config=self.model_config,
            engine_config=copy.deepcopy(self.engine_config),
            optimizer_config=self.optimizer_config,
            checkpoint_config=self.checkpoint_config,
        )
        engine.initialize()
        engine.module.requires_grad_(False)
        self._inputs_for_packed_rows(engine)
        return engine

    def _reference_logprobs(self, data) -> torch.Tensor:
        """Log-probs of the reference model on this micro-batch (logit positions, concatenated): the
        frozen initial model, or with LoRA this model with its adapter off (the base never trains)."""
        if self.ref_engine is None:
            with torch.no_grad(), self.engine.module.disable_adapter():
                _, output = self._verl_forward_step(data, loss_function=None, forward_only=True)
        else:
            with torch.no_grad(), self.ref_engine.eval_mode():
                _, output = self.ref_engine.forward_step(data, loss_function=None, forward_only=True)
        return output["model_output"]["log_probs"].values()

    # -------------------------------------------------------------------------------- training
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def agl_train(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on this rank's rows of one mini-batch; sums over the DP group."""
        started, started_cpu = time.perf_counter(), time.process_time()
        self._sums, self._maxima = defaultdict(float), defaultdict(float)
        self._current_version = int(payload["current_version"])
        apply = bool(payload["apply"])  # False: a zero-signal update (MiniBatch.update): measure, no step
        with self.engine.train_mode():
            self.engine.optimizer_zero_grad()
            for data in self._micro_batches(payload, train=True):  # gradients accumulate (at its temperature)
                self.engine.forward_backward_batch(data, loss_function=self._agl_loss, forward_only=not apply)
            grad_norm = float(self.engine.optimizer_step()) if apply else 0.0  # clip, step unless non-finite
        lr = float(self.engine.lr_scheduler.get_last_lr()[0])  # the rate this step used
        with schedule_may_lead():
            self.engine.lr_scheduler_step()
        sums = self._reduce(self._sums, torch.distributed.ReduceOp.SUM)
        maxima = self._reduce(self._maxima, torch.distributed.ReduceOp.MAX)
        return {
            "sums": sums,
            "maxima": maxima,
            "grad_norm": grad_norm,
            "lr": lr,
            "compute_s": time.perf_counter() - started,
            "compute_cpu_s": time.process_time() - started_cpu,  # all this worker's threads
        }

    def _forward_trained_positions(self, micro_batch, loss_function, forward_only):
        """verl's forward_step for a training micro-batch, with the output head, log-probs and entropy
        at the trained positions only; the model output keeps verl's shape (one value per position,
        zero where untrained) so the loss reads it as it reads verl's. Anything else goes to verl."""
        engine = self.engine
        head = engine.module.get_output_embeddings()
        if loss_function is None or head is None or "weights" not in micro_batch.keys():  # noqa: SIM118
            return self._verl_forward_step(micro_batch, loss_function, forward_only)
        from contextlib import nullcontext

        from verl.utils.device import get_device_id, get_device_name
        from verl.workers.engine.utils import detach_tree

        micro_batch = micro_batch.to(get_device_id())
        temperature = float(micro_batch["temperature"])  # the loss's (algorithm.loss_temperature)
        model_inputs, _ = engine.prepare_model_inputs(micro_batch=micro_batch)
        input_ids = micro_batch["input_ids"]
        offsets = input_ids.offsets()
        packed = input_ids.values()
        trained = (micro_batch["weights"].values() != 0).nonzero().squeeze(-1)  # logit positions
        labels = torch.roll(packed, shifts=-1)[trained]  # the token each trained logit predicts
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            rows, positions = torch.zeros_like(trained), trained  # hidden states [1, total, H]
        else:  # hidden states [rows, longest, H]
            rows = torch.searchsorted(offsets[1:], trained, right=True)
            positions = trained - offsets[rows]
        autocast_dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
        autocast = (
            nullcontext()
            if autocast_dtype == torch.float32
            else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)
        )
        with autocast:
            with head_sees_only(head, rows, positions):
                logits = engine.module(**model_inputs, use_cache=False).logits[0]  # [trained, V]
            calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)

            def every_position(values: torch.Tensor) -> torch.Tensor:
                # a padding-only micro-batch keeps a graph through the model (FSDP's backward collectives)
                full = torch.zeros(packed.numel(), dtype=values.dtype, device=values.device)
                return torch.nested.nested_tensor_from_jagged(full.index_put((trained,), values), offsets)

            log_prob, entropy = token_outputs(  # backends/chunked_logprobs.py, as the torch backend
                logits,
                labels,
                with_entropy=calculate_entropy,
                entropy_grad=self.settings.training.algorithm.entropy_coef > 0,  # else _agl_loss detaches it
                chunk_tokens=self.settings.training.logit_chunk_tokens,
                temperature=temperature,
            )
            model_output = {"log_probs": every_position(log_prob)}
            # the model's own too, for agreement and importance (the engine's kind), unless the driver's
            # pre-update pass sent them
            if temperature != 1.0 and "before_logprobs" not in micro_batch.keys():  # noqa: SIM118 - a TensorDict
                with torch.no_grad():
                    own, _ = token_outputs(
                        logits.detach(),
                        labels,
                        with_entropy=False,
                        chunk_tokens=self.settings.training.logit_chunk_tokens,
                    )
                model_output["own_log_probs"] = every_position(own)
            if entropy is not None:
                model_output["entropy"] = every_position(entropy)
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=engine.get_data_parallel_group()
            )
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}

    def _agl_loss(self, model_output: dict[str, Any], data, dp_group=None):
        algo: AlgorithmConfig = self.settings.training.algorithm
        weights = data["weights"].values()
        keep = weights != 0
        log_prob_all = model_output["log_probs"].values()
        self._count_micro_batch(data)
        if not bool(keep.any()):
            return (log_prob_all * 0.0).sum(), {}  # a rank's padding rows: no loss, but join the backward
        log_prob = log_prob_all[keep]
        w = weights[keep].float()
        entropy = model_output.get("entropy")
        entropy = entropy.values()[keep] if entropy is not None else None
        if entropy is not None and algo.entropy_coef == 0:
            entropy = entropy.detach()

        def kept(name: str) -> torch.Tensor | None:  # a payload field the driver may leave out
            return data[name].values()[keep].float() if name in data.keys() else None  # noqa: SIM118 - a TensorDict

        tokens = KeptTokens(  # backends/microbatch_loss.py: the torch backend's loss, the same math
            weights=w,
            advantages=data["advantages"].values()[keep].float(),
            engine_logprobs=data["engine_logprobs"].values()[keep].float(),
            known=data["known"].values()[keep],
            versions=data["versions"].values()[keep],
            switched=data["switched"].values()[keep],
            old_logprobs=kept("old_logprobs"),
            before_logprobs=kept("before_logprobs"),
            ref_logprobs=self._reference_logprobs(data)[keep].float() if algo.kl_coef > 0 else None,
        )
        own = model_output.get("own_log_probs")
        own = own.values()[keep] if own is not None else None
        out = micro_batch_loss(algo, log_prob, entropy, tokens, self._current_version, own_log_prob=own)
        for key, value in out.sums.items():
            self._sums[key] += value
        for key, value in out.maxima.items():
            self._maxima[key] = max(self._maxima[key], value)
        return out.loss * self.engine.get_data_parallel_size(), {}

    def _count_micro_batch(self, data) -> None:
        lengths = data["input_ids"].offsets().diff()
        real = int(lengths.sum())
        self._sums["micro_batches"] += 1
        self._sums["real_positions"] += real
        if not self.settings.use_remove_padding:
            self._sums["padded_positions"] += int(lengths.numel() * lengths.max()) - real

    def _reduce(self, values: dict[str, float], op) -> dict[str, float]:
        """`values` summed (or maxed) over the DP group. The ranks first agree on the keys: a rank
        with only padding rows has no loss metrics, and all_reduce of tensors of different sizes
        (or on one rank only) aborts inside gloo (Pair::prepareRead)."""
        group = self.engine.get_data_parallel_group()
        size = torch.distributed.get_world_size(group)
        keys = sorted(values)
        if size > 1:
            everyone: list[list[str] | None] = [None] * size
            torch.distributed.all_gather_object(everyone, keys, group=group)
            keys = sorted(set().union(*(k or [] for k in everyone)))
        if not keys:
            return {}
        missing = float("-inf") if op == torch.distributed.ReduceOp.MAX else 0.0
        tensor = torch.tensor([values.get(k, missing) for k in keys], dtype=torch.float64)
        if size > 1:
            tensor = tensor.to(self.device_name)
            torch.distributed.all_reduce(tensor, op=op, group=group)
        return dict(zip(keys, tensor.cpu().tolist(), strict=True))

    # ------------------------------------------------------------------------------- inference
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def agl_logprobs(self, payload: dict[str, Any]) -> torch.Tensor:
        """Log-probs at logit positions (value t: log p(token t + 1)), concatenated over this rank's rows."""
        outputs = []
        with self.engine.eval_mode():
            for data in self._micro_batches(payload, train=False):
                output = self.engine.infer_batch(data, loss_function=None)
                outputs.append(output["model_output"]["log_probs"].values().float().cpu())
        return torch.cat(outputs)

    def _micro_batches(self, payload: dict[str, Any], *, train: bool):
        """The payload's micro-batches (consecutive rows, `micro_rows` of them each) as TensorDicts."""
        lengths = payload["lengths"].long()
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)
        row = 0
        for count in payload["micro_rows"]:
            start, end = int(offsets[row]), int(offsets[row + count])
            part = {"lengths": lengths[row : row + count]}
            for name, value in payload.items():
                if isinstance(value, torch.Tensor) and name != "lengths":
                    part[name] = value[start:end]
            row += count
            yield self._tensordict(part, train=train, temperature=float(payload.get("temperature", 1.0)))

    def _tensordict(self, payload: dict[str, Any], *, train: bool, temperature: float = 1.0):
        lengths = payload["lengths"].long()
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)

        def nested(values: torch.Tensor) -> torch.Tensor:
            return torch.nested.nested_tensor_from_jagged(values, offsets)

        tensors = {
            "input_ids": nested(payload["input_ids"].long()),
            "position_ids": nested(payload["position_ids"].long()),
            "loss_mask": nested(payload["loss_mask"].float()),
        }
        if train:
            for name in SHIFTED_FIELDS:
                if name in payload:
                    tensors[name] = nested(payload[name])
        non_tensors = {
            "temperature": temperature,  # verl's forward (and agl's, _forward_trained_positions) divide by it
            "use_remove_padding": self.settings.use_remove_padding,
            # the driver made the micro-batches (payload.plan_ranks): verl runs each as one
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": int(lengths.numel()),
            "use_fused_kernels": False,
            "calculate_entropy": train,
            "global_token_num": lengths.tolist(),
        }
        return tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=non_tensors)

    # --------------------------------------------------------------------------------- weights
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_state_dict(self, dtype: torch.dtype | None = None) -> tuple[list[Any], list[Any]] | None:
        """Full tensors under HF names on rank 0, as WeightBuckets.to_wire (a few NumPy buffers, which
        Ray moves out of band; None elsewhere). Every rank walks the generator: each tensor's gather
        is a collective. A tied output embedding appears once. With LoRA: base + adapter merged, as
        the torch backend merges them (lora.merged_tensors)."""
        from verl.utils.model import convert_weight_keys

        module = self.engine.module
        is_rank0 = torch.distributed.get_rank() == 0
        if self.settings.lora is not None:
            merging = BucketWriter(staging=self._export_staging)  # merged_tensors casts already
            for name, tensor in lora.merged_tensors(module, dtype):  # every rank: each gather is a collective
                if is_rank0:
                    merging.add(name, tensor)
            exported = merging.finish().to_wire() if is_rank0 else None
            self._hand_back_cached_memory()
            return exported
        seen: set[int] = set()
        duplicates = {}
        for name, parameter in module.named_parameters(remove_duplicate=False):
            if id(parameter) in seen:
                duplicates[name] = None  # tied to a parameter listed before it (lm_head to embed_tokens)
            seen.add(id(parameter))
        tied = set(convert_weight_keys(duplicates, getattr(module, "_fsdp_wrapped_module", module)))
        writer = BucketWriter(dtype, staging=self._export_staging)  # cast on the device, one copy to the host
        for name, tensor in self._full_tensors(dtype):
            if is_rank0 and name not in tied:
                writer.add(name, tensor)
        exported = writer.finish().to_wire() if is_rank0 else None
        self._hand_back_cached_memory()
        return exported

    def _full_tensors(self, dtype: torch.dtype | None):
        """(HF name, full tensor) per weight, every rank taking part in each gather. For FSDP2 (no
        LoRA, no QAT) as verl's get_per_tensor_param walks them, but a shard about to be gathered or
        on an accelerator is cast to `dtype` first (a cast is elementwise, so cast-then-gather is the
        same tensor, with half the bytes gathered for bfloat16), and a one-rank mesh's shard is the
        tensor itself (no gather; on the CPU the bucket's copy casts it). Otherwise verl's own."""
        from torch.distributed.tensor import DTensor
        from verl.utils.device import get_device_id
        from verl.utils.fsdp_utils import fsdp_version
        from verl.utils.model import convert_weight_keys
        from verl.workers.engine.fsdp.utils import unfuse_moe_params

        engine, module = self.engine, self.engine.module
        inner = getattr(module, "_fsdp_wrapped_module", module)
        if fsdp_version(module) != 2 or hasattr(inner, "peft_config") or getattr(engine, "_qat_enabled", False):
            per_tensor, _ = engine.get_per_tensor_param()
            yield from per_tensor
            return
        device = get_device_id()

        def gathered():
            for name, param in convert_weight_keys(module.state_dict(), inner).items():
                param = param.to(device, non_blocking=True)
                alone = not isinstance(param, DTensor) or param.device_mesh.size() == 1
                if dtype is not None and param.is_floating_point() and not (alone and param.device.type == "cpu"):
                    param = param.to(dtype)
                if isinstance(param, DTensor):
                    param = param.to_local() if alone else param.full_tensor()
                yield name, param

        yield from unfuse_moe_params(gathered(), engine.model_config.hf_config.model_type)

    def _hand_back_cached_memory(self) -> None:
        """After an export for the engine (the engine wakes next), the caching allocator's blocks go
        back to the device, as the torch backend does (a collocated engine takes that memory)."""
        from verl.utils.device import get_torch_device

        get_torch_device().empty_cache()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_adapter(self, dtype: torch.dtype | None = None) -> AdapterState | None:
        """The adapter, gathered from the shards (every rank takes part), on rank 0; None elsewhere."""
        state = lora.adapter_state(self.engine.module, dtype)
        self._hand_back_cached_memory()
        return state if torch.distributed.get_rank() == 0 else None

    # ----------------------------------------------------------------------------- checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path, global_step=0, max_ckpt_to_keep=None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path, del_local_after_load=False)
