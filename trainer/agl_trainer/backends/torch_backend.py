"""The torch backend: one process, CPU or one CUDA GPU, any Hugging Face causal LM.

`TorchBackend.train_step(batch, policy_version)` is the whole update and reads top to bottom:
advantages per rollout, global token weights, then for each mini-batch (whole rollouts only)
forward/backward over packed micro-batches, clip, step. See `agl_trainer.backends` for the public API.
With `lora.rank` > 0 the model is a peft model whose base is frozen (backends/lora.py): the same
update trains the adapters only, and the KL reference is the base, the adapters switched off.
"""

from __future__ import annotations

import inspect
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from agl_trainer.backends import lora, varlen_attention
from agl_trainer.backends.agreement import PREFIX as AGREE
from agl_trainer.backends.batch_checks import validate_batch
from agl_trainer.weights.peft_files import read_adapter
from agl_trainer.weights.tied_head import HEAD_WEIGHT, config_for_weights
from agl_trainer.weights.update import AdapterState
from agl_trainer.backends.checkpoint_io import (
    atomic_directory,
    check_loaded,
    copy_tokenizer_files,
    rng_state,
    seed_everything,
    set_rng_state,
)
from agl_trainer.backends.chunked_logprobs import token_outputs
from agl_trainer.backends.hf_model import (
    disable_dropout,
    head_sees_only,
    head_selection_works,
    resolve_device,
    supports_packing,
)
from agl_trainer.backends.microbatch_loss import KeptTokens, micro_batch_loss
from agl_trainer.backends.packing import ComputeModel, MicroBatch, plan_micro_batches
from agl_trainer.backends.schedule import LRLambda, schedule_may_lead
from agl_trainer.backends.step_metrics import step_metrics
from agl_trainer.backends.step_plan import StepPlan, algorithm_batch, mini_batches, plan_step
from agl_trainer.backends.targets import Targets, trained_targets
from agl_trainer.backends.torch_config import DTYPES, BackendConfigError, TorchBackendConfig
from agl_trainer.backends.weight_buckets import host_copy
from agl_trainer.batch import TrainingBatch
from agl_trainer.models.hf_progress import quiet_progress


class TorchBackend:
    def __init__(self, config: TorchBackendConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.device = resolve_device(config.device)
        param_dtype = DTYPES[config.param_dtype]
        if config.compute_dtype == "auto":  # bfloat16 on a GPU; on a CPU, whatever the weights are
            compute = DTYPES["bfloat16"] if self.device.type == "cuda" else param_dtype
        else:
            compute = DTYPES[config.compute_dtype]
        # autocast only lowers precision; float32 compute over bfloat16 weights is not a thing it does
        self.autocast_dtype = compute if compute != param_dtype and compute != torch.float32 else None
        seed_everything(config.seed)
        kwargs: dict[str, Any] = {"dtype": param_dtype, "trust_remote_code": config.trust_remote_code}
        if config.attn_implementation == varlen_attention.NAME:
            if self.device.type == "cuda" and not varlen_attention.available_on(self.device):
                raise BackendConfigError(
                    f"backend.attn_implementation: {varlen_attention.NAME} needs torch.nn.attention.varlen "
                    f"(PyTorch >= 2.9) on CUDA, which torch {torch.__version__} lacks; use sdpa"
                )
            varlen_attention.register()  # packed rows at each sample's cost (backends/varlen_attention.py)
        if config.attn_implementation:
            kwargs["attn_implementation"] = config.attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(str(config.model_path), **kwargs).to(self.device)
        self.model.config.use_cache = False
        if config.disable_dropout:
            disable_dropout(self.model)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.compute_model = ComputeModel.of(
            int(self.model.get_input_embeddings().weight.shape[1]), self.model.config._attn_implementation
        )
        self.ref_model = None
        if config.algorithm.kl_coef > 0 and not config.lora.enabled:  # with LoRA: the base, adapters off
            self.ref_model = AutoModelForCausalLM.from_pretrained(str(config.model_path), **kwargs).to(
                self.device
            )
            self.ref_model.eval().requires_grad_(False)
        self._takes_positions = "position_ids" in inspect.signature(self.model.forward).parameters
        self.model.eval()  # probes must not see dropout
        if not self._takes_positions:  # packed samples are told apart by their position_ids only
            if config.packing == "packed":
                raise BackendConfigError(
                    f"backend.packing: packed, but {type(self.model).__name__}.forward takes no position_ids "
                    "to tell packed samples apart; use packing: auto or padded"
                )
            self.packed = False
        elif config.packing == "auto":
            tolerance = 1e-3 if param_dtype == torch.float32 else 5e-2
            self.packed = supports_packing(self.model, self.device, tolerance)
        else:
            self.packed = config.packing == "packed"
        self._selects_hidden = head_selection_works(self.model, self.device)
        if config.lora.enabled:  # after the probes: peft's forward hides the model's signature
            self.model = self._with_adapters(config)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            LRLambda(config.warmup_steps, config.total_steps, config.lr_schedule, config.min_lr_ratio),
        )
        self.step = 0  # optimizer steps taken
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient
        self.last_logprobs: torch.Tensor | None = None  # of the last train_step's batch, [N, L]

    def _with_adapters(self, config: TorchBackendConfig) -> Any:
        model = lora.wrap(self.model, config.lora)
        if config.gradient_checkpointing:  # checkpointed blocks over a frozen base need an input with grad
            model.enable_input_require_grads()
        return model

    @property
    def uses_lora(self) -> bool:
        return self.config.lora.enabled

    # ----------------------------------------------------------------------------------- training
    def train_step(self, batch: TrainingBatch, policy_version: int) -> dict[str, float]:
        """One update on the whole batch (num_mini_batches x ppo_epochs optimizer steps; 1 by default).
        `policy_version` is the current one (the loop owns it): tokens generated by older versions are
        stale. Returns metrics; their policy_version is the one this update produces."""
        started = time.perf_counter()
        algo = self.config.algorithm
        batch = algorithm_batch(batch, algo)
        plan = plan_step(batch, algo, self.vocab_size, policy_version)
        lengths, token_advantages = plan.lengths, plan.token_advantages
        before = None  # the trainer's pre-update log-probs, where no forward of this step gives them
        if algo.bypass_old_logprobs:
            old_log_prob = batch.engine_logprobs.float()
            if self.config.updates_per_step > 1:  # agreement and re-scoring need the sampling weights'
                before = self.compute_logprobs(batch)
        elif self.config.updates_per_step > 1:
            old_log_prob = self.compute_logprobs(batch, temperature=algo.temperature)
            if algo.temperature != 1.0:  # agreement and importance weights: the model's own, as the engine's
                before = self.compute_logprobs(batch)
        else:
            old_log_prob = None  # one update: the old policy is the current one, read from the same forward
        tokens = _TokenInputs.of(batch, plan, old_log_prob, before, policy_version)
        self.last_logprobs = tokens.record  # pre-update logprobs of the trained tokens (NaN elsewhere)

        sums: dict[str, float] = defaultdict(float)
        maxima: dict[str, float] = defaultdict(float)
        grad_norms: list[float] = []
        for epoch in range(self.config.ppo_epochs):
            for mini in mini_batches(batch, plan, algo, self.config.num_mini_batches):
                self.optimizer.zero_grad(set_to_none=True)
                sums["zero_signal_updates"] += not mini.update
                for micro in self._plan(batch, lengths, mini.samples):
                    sums["micro_batches"] += 1
                    sums["real_positions"] += micro.num_tokens
                    sums["padded_positions"] += micro.num_positions - micro.num_tokens
                    stats = self._forward_backward(micro, mini.weights, token_advantages, tokens, mini.update)
                    for key, value in stats.items():
                        if epoch > 0 and key.startswith(AGREE):
                            continue  # the same tokens against the same pre-update log-probs: once
                        if key.endswith("_max"):
                            maxima[key] = max(maxima[key], value)
                        else:
                            sums[key] += value
                grad_norms.append(self._optimizer_step(mini.update))

        lr = float(self.scheduler.get_last_lr()[0])
        elapsed = time.perf_counter() - started
        produced = policy_version + 1
        return step_metrics(self.step, produced, self.skipped_steps, plan, sums, maxima, grad_norms, lr, elapsed)

    def _forward_backward(
        self,
        micro: MicroBatch,
        weights: torch.Tensor,
        advantages: torch.Tensor,
        tokens: _TokenInputs,
        backward: bool = True,
    ) -> dict[str, float]:
        """The micro-batch's loss and statistics; its gradient accumulates unless `backward` is False
        (a zero-signal update: the forward still measures agreement and entropy)."""
        algo = self.config.algorithm
        w = micro.gather(weights)
        keep = trained_targets(w != 0)
        if keep is None:
            return {}
        want_entropy_grad = algo.entropy_coef > 0 and backward

        def select(per_token: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            return keep.select(micro.gather(per_token, fill=fill)).to(self.device)

        def select_some(per_token: torch.Tensor | None) -> torch.Tensor | None:
            return None if per_token is None else select(per_token)

        temperature = algo.temperature
        with torch.set_grad_enabled(backward):
            logits, labels = self._kept_logits(self.model, micro, keep)
            log_prob, entropy = self._outputs(
                logits, labels, entropy_grad=want_entropy_grad, temperature=temperature
            )
        own = None  # at another temperature, the model's own log-probs too (the engine's kind), unless
        if temperature != 1.0 and tokens.before is None:  # a pre-update pass gave them
            with torch.no_grad():
                own = self._outputs(logits.detach(), labels, with_entropy=False)[0]
        del logits
        ref = self._reference_logprobs(micro, keep)
        kept = KeptTokens(
            weights=keep.select(w).to(self.device),
            advantages=select(advantages),
            engine_logprobs=select(tokens.engine),
            known=select(tokens.known),
            versions=select(tokens.batch.policy_versions, fill=-1),
            switched=select(tokens.switched),
            old_logprobs=select_some(tokens.old),
            before_logprobs=select_some(tokens.before),
            ref_logprobs=ref,
        )
        out = micro_batch_loss(algo, log_prob, entropy, kept, tokens.version, own_log_prob=own)
        if backward:
            out.loss.backward()
        recording = time.perf_counter()
        flat = micro.source[keep.rows, keep.positions + 1]  # the kept tokens' places in the batch
        tokens.record.view(-1)[flat.cpu()] = out.before.detach().float().cpu()
        out.sums["agreement_s"] += time.perf_counter() - recording
        return {**out.sums, **out.maxima}

    @torch.no_grad()
    def _reference_logprobs(self, micro: MicroBatch, keep: Targets) -> torch.Tensor | None:
        """The KL reference's log-probs at the loss's temperature: the initial model, or with LoRA the
        base (adapters off)."""
        algo = self.config.algorithm
        if algo.kl_coef <= 0:
            return None
        if self.uses_lora:
            with self.model.disable_adapter():
                logits, labels = self._kept_logits(self.model, micro, keep)
        else:
            assert self.ref_model is not None
            logits, labels = self._kept_logits(self.ref_model, micro, keep)
        return self._outputs(logits, labels, with_entropy=False, temperature=algo.temperature)[0]

    def _optimizer_step(self, apply: bool = True) -> float:
        """Clip and step; returns the gradient norm. `apply` False (a zero-signal update: no backward
        ran) leaves the weights and AdamW's state as they are. Either way the step counts, for the
        learning-rate schedule too."""
        norm = torch.zeros(())
        if apply:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if self.config.max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
            elif params:
                norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
            if torch.isfinite(norm):
                self.optimizer.step()
            else:  # a NaN/inf gradient would poison the weights and the AdamW state: skip, and report it
                self.skipped_steps += 1
        with schedule_may_lead():
            self.scheduler.step()
        self.step += 1
        return float(norm)

    # ---------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """The current policy's log-prob of every trained token (loss_mask 1), [N, L] on the CPU; 0 elsewhere;
        of softmax(logits / temperature) (1: the model's own, as an engine reports them)."""
        lengths = validate_batch(batch, self.vocab_size)
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        for micro in self._plan(batch, lengths, list(range(batch.num_samples))):
            keep = trained_targets(micro.gather(batch.loss_mask.float()) != 0)
            if keep is None:
                continue
            logits, labels = self._kept_logits(self.model, micro, keep)
            log_prob, _ = self._outputs(logits, labels, with_entropy=False, temperature=temperature)
            micro.scatter_into(out, keep.scatter(log_prob.float().cpu(), micro.source.shape))
        return out

    def _plan(self, batch: TrainingBatch, lengths: torch.Tensor, samples: list[int]) -> list[MicroBatch]:
        return plan_micro_batches(
            batch.input_ids,
            batch.position_ids,
            lengths,
            samples,
            token_budget=self.config.micro_batch_tokens,
            packed=bool(self.packed),
            row_capacity=self.config.max_row_tokens,
            compute=self.compute_model,
        )

    def _outputs(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        with_entropy: bool = True,
        entropy_grad: bool = False,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_outputs(
            logits,
            labels,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=self.config.logit_chunk_tokens,
            temperature=temperature,
        )

    def _kept_logits(
        self, model: torch.nn.Module, micro: MicroBatch, keep: Targets
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits [K, V] at the kept positions and the tokens they predict [K]; the output head runs
        only where needed."""
        inputs: dict[str, Any] = {"input_ids": micro.input_ids.to(self.device), "use_cache": False}
        if self._takes_positions:
            inputs["position_ids"] = micro.position_ids.to(self.device)
        if micro.attention_mask is not None:
            inputs["attention_mask"] = micro.attention_mask.to(self.device)
        rows, positions = keep.rows.to(self.device), keep.positions.to(self.device)
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            if self._selects_hidden:
                with head_sees_only(model.get_output_embeddings(), rows, positions):
                    logits = model(**inputs).logits[0]  # [K, V]
            else:
                logits = model(**inputs).logits[rows, positions]
        return logits, micro.input_ids.to(self.device)[rows, positions + 1]

    # ------------------------------------------------------------------------------------ weights
    def state_dict_for_engine(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The policy's weights as CPU tensors (copies) under Hugging Face names, as save_pretrained
        writes them (a tied output embedding appears once, under the input embedding's name). With
        LoRA: base + adapter merged, under the base model's names, so any engine loads them."""
        if self.uses_lora:
            merged = lora.merged_state_dict(self.model, dtype)
            self._hand_back_cached_memory()
            return merged
        seen: set[int] = set()
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.model.state_dict().items():
            key = tensor.data_ptr()
            if key in seen and tensor.numel() > 0:
                continue  # tied to a tensor already included
            seen.add(key)
            out[name] = host_copy(tensor, dtype)  # cast on its device, then one copy to the host
        self._hand_back_cached_memory()
        return out

    def adapter_for_engine(self, dtype: torch.dtype | None = None) -> AdapterState:
        """The adapter alone (peft's names and config, CPU copies): what an adapter-only sync moves."""
        if not self.uses_lora:
            raise ValueError("adapter_for_engine: this backend trains every weight (backend.lora.rank is 0)")
        state = lora.adapter_state(self.model, dtype)
        self._hand_back_cached_memory()
        return state

    def _hand_back_cached_memory(self) -> None:
        """After the export for the engine nothing of the step is live, and the engine wakes next
        (collocated vLLM, engine.update_weights): the caching allocator's blocks, the step's peak, go
        back to CUDA so that engine gets them. The next step allocates again (milliseconds)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def save_hf(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """The policy as a Hugging Face directory (safetensors + config + the source's tokenizer files),
        loadable by transformers and vLLM; with LoRA the merged weights. Written to a temporary
        sibling, then moved into place."""
        directory = Path(directory)

        def write(tmp: Path) -> None:
            state = self.state_dict_for_engine(dtype) if dtype is not None or self.uses_lora else None
            model = self.model.get_base_model() if self.uses_lora else self.model
            with quiet_progress():  # no "Writing model shards" bar per save
                model.save_pretrained(tmp, state_dict=state)
            if state is not None and HEAD_WEIGHT in state:  # a tied head merged with its adapter: untied
                config = json.loads((tmp / "config.json").read_text())
                (tmp / "config.json").write_text(json.dumps(config_for_weights(config, state), indent=2))
            copy_tokenizer_files(Path(self.config.model_path), tmp)

        atomic_directory(directory, write)
        return directory

    def save_adapter(self, directory: str | Path) -> Path:
        """The bare adapter in peft's format (adapter_model.safetensors + adapter_config.json): what
        PeftModel.from_pretrained and vLLM's LoRA loading read."""
        if not self.uses_lora:
            raise ValueError("save_adapter: this backend trains every weight (backend.lora.rank is 0)")
        directory = Path(directory)
        atomic_directory(directory, lambda tmp: lora.save_adapter(self.model, tmp))
        return directory

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""

    def save_checkpoint(self, directory: str | Path) -> Path:
        """model/ (save_pretrained), or with LoRA adapter/ (peft's format; the base is model_path's) +
        trainer_state.pt (optimizer, scheduler, step, RNG states). The policy version is the loop's, in
        its own checkpoint beside this one."""
        directory = Path(directory)

        def write(tmp: Path) -> None:
            if self.uses_lora:
                lora.save_adapter(self.model, tmp / "adapter")
            else:
                with quiet_progress():  # a checkpoint every N steps: no "Writing model shards" bar each time
                    self.model.save_pretrained(tmp / "model")
                copy_tokenizer_files(Path(self.config.model_path), tmp / "model")
            torch.save(
                {
                    "format": 1,
                    "step": self.step,
                    "skipped_steps": self.skipped_steps,
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "rng": rng_state(),
                    "config": _config_summary(self.config),
                },
                tmp / "trainer_state.pt",
            )

        atomic_directory(directory, write)
        return directory

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what save_checkpoint wrote; the next train_step is then the one that would have followed."""
        from safetensors.torch import load_file

        directory = Path(directory)
        state_path, model_dir = directory / "trainer_state.pt", directory / "model"
        adapter_dir = directory / "adapter"
        files = sorted(model_dir.glob("*.safetensors"))
        if not state_path.is_file() or not (files or adapter_dir.is_dir()):
            raise FileNotFoundError(
                f"{directory} is not an agl checkpoint (want model/*.safetensors or adapter/, and "
                "trainer_state.pt, as written by save_checkpoint)"
            )
        lora.check_checkpoint_kind(directory, adapter_dir.is_dir(), self.uses_lora)
        if self.uses_lora:
            saved = read_adapter(adapter_dir)
            lora.check_same_adapter(lora.adapter_state(self.model).config, saved.config)
            lora.load_adapter_weights(self.model, saved.weights)
        else:
            weights: dict[str, torch.Tensor] = {}
            for file in files:
                weights.update(load_file(file))
            result = self.model.load_state_dict(weights, strict=False)
            check_loaded(self.model, weights, result)
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])  # older checkpoints also carry a policy_version: the loop's is used
        self.skipped_steps = int(state.get("skipped_steps", 0))
        set_rng_state(state["rng"])


# -------------------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _TokenInputs:
    """The step's per-token inputs besides weights and advantages, [N, L] on the CPU."""

    batch: TrainingBatch
    engine: torch.Tensor  # the engine's logprobs (0.0 where unknown)
    known: torch.Tensor  # 1.0 where the engine's logprob is known
    switched: torch.Tensor  # 1.0 where sampled after a keep switch
    old: torch.Tensor | None  # PPO's old log-probs, when computed before the update
    before: torch.Tensor | None  # the pre-update log-probs, when neither `old` nor the forward gives them
    version: int  # the policy version being trained
    record: torch.Tensor  # [N, L] written: the trainer's pre-update logprobs of the trained tokens

    @classmethod
    def of(
        cls, batch: TrainingBatch, plan: StepPlan, old: torch.Tensor | None, before: torch.Tensor | None, version: int
    ) -> _TokenInputs:
        engine = batch.engine_logprobs.float()
        record = torch.full(batch.loss_mask.shape, float("nan"))
        return cls(batch, engine, plan.missing.known.float(), plan.switched.float(), old, before, version, record)


def _config_summary(config: TorchBackendConfig) -> dict[str, Any]:
    """The settings as plain values (the LoRA section is a msgspec Struct, paths are strings)."""
    return msgspec.to_builtins(config, enc_hook=str)


__all__ = ["BackendConfigError", "TorchBackend", "TorchBackendConfig"]
