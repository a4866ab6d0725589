"""`VerlBackend`: the torch backend's interface over verl's FSDP2 workers in a Ray worker group.

`train_step` reads like `TorchBackend.train_step`: advantages per rollout and per-token weights are
computed here, on the driver, over the whole batch (step_plan, shared with the torch backend); each
mini-batch (whole rollouts) is dealt to the data-parallel ranks and is one optimizer step on the workers.
With `lora.rank` > 0 the workers train a peft adapter over the frozen base (worker.py), as the torch
backend does: engines get the adapter alone (`adapter_for_engine`) or the merged weights.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from agl_trainer.backends import lora
from agl_trainer.backends.agreement import PREFIX as AGREE
from agl_trainer.backends.batch_checks import validate_batch
from agl_trainer.backends.checkpoint_io import atomic_directory, copy_tokenizer_files
from agl_trainer.backends.packing import ComputeModel, pack_samples
from agl_trainer.backends.step_metrics import step_metrics
from agl_trainer.backends.step_plan import algorithm_batch, mini_batches, plan_step
from agl_trainer.backends.torch_config import BackendConfigError
from agl_trainer.backends.verl import cluster
from agl_trainer.backends.verl.config import VerlBackendConfig, has_flash_attn
from agl_trainer.backends.verl.payload import Plan, flat_samples, payload, plan_ranks, scatter_logprobs
from agl_trainer.backends.weight_buckets import WeightBuckets
from agl_trainer.batch import TrainingBatch
from agl_trainer.weights.peft_files import read_adapter, write_adapter
from agl_trainer.weights.tied_head import config_for_weights
from agl_trainer.weights.update import AdapterState

DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "summary_dropout_prob",
    "classifier_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)
CHECKPOINT_STATE = "agl_state.json"
CHECKPOINT_ADAPTER = "adapter"  # with LoRA: the adapter in peft's format, as the torch backend writes it


class VerlBackend:
    def __init__(self, config: VerlBackendConfig) -> None:
        self.config = config
        self.training = config.training
        self.step = 0  # optimizer steps taken
        self.skipped_steps = 0
        self._ray: cluster.RayHandle | None = None
        self._workers: Any = None
        cluster.prepare_driver(config)
        self._ray = cluster.connect(config)
        try:
            self._workers = cluster.start_workers(config, self._worker_settings())
            self.ranks: list[dict[str, Any]] = self._workers.agl_init()
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(self.ranks[0]["vocab_size"])
        self.last_logprobs = None  # the trainer's per-token logprobs stay in the workers
        self.dp_size = int(self.ranks[0]["dp_size"])
        # the workers probed the model as the torch backend does: do packed samples stay apart?
        self.packed = bool(self.ranks[0]["packed"])
        self.compute_model = ComputeModel.of(int(self.ranks[0]["hidden_size"]), self._attention)
        # the first global rank of each data-parallel rank answers for it (ulysses ranks repeat it)
        self._answering = {}
        for info in self.ranks:
            self._answering.setdefault(int(info["dp_rank"]), int(info["rank"]))

    @property
    def uses_lora(self) -> bool:
        return self.training.lora.enabled

    @property
    def _attention(self) -> str:
        t = self.training
        on_gpu = self.config.device == "cuda"
        return t.attn_implementation or ("flash_attention_2" if on_gpu and has_flash_attn() else "sdpa")

    def _worker_settings(self):
        """The settings as they are (backend.options with the rest of the torch backend's, backend.verl as
        declared), and what only the driver resolves: the attention, dtypes and process group for the
        workers' device, and the model config's dropout keys."""
        import msgspec

        from agl_trainer.backends.settings import VerlSettings
        from agl_trainer.backends.verl.worker import WorkerSettings

        t, on_gpu = self.training, self.config.device == "cuda"
        model_dtype = "bf16" if t.param_dtype == "bfloat16" else "fp32"
        if t.compute_dtype == "auto":
            compute = "bf16" if on_gpu else model_dtype
        else:
            compute = "bf16" if t.compute_dtype == "bfloat16" else "fp32"
        return WorkerSettings(
            training=t,
            # the backend.verl section alone: VerlBackendConfig's own checks (Ray reachable, CUDA here) are
            # the driver's, and would run again where a worker unpickles it
            verl=msgspec.convert(self.config, VerlSettings, from_attributes=True),
            attn_implementation=self._attention,
            model_dtype=model_dtype,
            compute_dtype=compute,
            dist_backend="cpu:gloo" if not on_gpu else None,
            model_override=_dropout_off(Path(t.model_path)) if t.disable_dropout else {},
        )

    # ----------------------------------------------------------------------------------- training
    def train_step(self, batch: TrainingBatch, policy_version: int) -> dict[str, float]:
        """One update on the whole batch (num_mini_batches x ppo_epochs optimizer steps). `policy_version`
        is the current one (the loop owns it): tokens generated by older versions are stale."""
        started = time.perf_counter()
        t, algo = self.training, self.training.algorithm
        batch = algorithm_batch(batch, algo)
        plan = plan_step(batch, algo, self.vocab_size, policy_version)
        lengths = plan.lengths
        per_token = {
            "advantages": plan.token_advantages.float(),
            "engine_logprobs": batch.engine_logprobs.float(),
            "versions": batch.policy_versions.long(),
            "known": plan.missing.known.float(),  # backends/agreement.py: unknown ones re-scored
            "switched": plan.switched.float(),
        }
        if algo.bypass_old_logprobs:
            per_token["old_logprobs"] = batch.engine_logprobs.float()
            if t.updates_per_step > 1:  # agreement and re-scoring need the pre-update log-probs
                per_token["before_logprobs"] = self.compute_logprobs(batch)
        elif t.updates_per_step > 1:
            per_token["old_logprobs"] = self.compute_logprobs(batch, temperature=algo.temperature)
            if algo.temperature != 1.0:  # agreement and importance weights: the model's own, as the engine's
                per_token["before_logprobs"] = self.compute_logprobs(batch)

        sums: dict[str, float] = defaultdict(float)
        maxima: dict[str, float] = defaultdict(float)
        grad_norms: list[float] = []
        lr, dispatch_s, worker_cpu_s = t.lr, 0.0, 0.0
        for epoch in range(t.ppo_epochs):
            for mini in mini_batches(batch, plan, algo, t.num_mini_batches):
                sent = {**per_token, "weights": mini.weights}
                sums["zero_signal_updates"] += not mini.update
                results, _, wall = self._call(
                    "agl_train", batch, lengths, mini.samples, sent, policy_version, mini.update, algo.temperature
                )
                dispatch_s += wall - max(r["compute_s"] for r in results)
                worker_cpu_s += results[0]["compute_cpu_s"]
                first = results[0]
                for key, value in first["sums"].items():
                    if epoch == 0 or not key.startswith(AGREE):  # agreement: each token once
                        sums[key] += value
                for key, value in first["maxima"].items():
                    if epoch == 0 or not key.startswith(AGREE):
                        maxima[key] = max(maxima[key], value)
                grad_norms.append(first["grad_norm"])
                lr = first["lr"]
                if not torch.isfinite(torch.tensor(first["grad_norm"])):
                    self.skipped_steps += 1  # verl skipped the update (non-finite gradient)
                self.step += 1

        elapsed = time.perf_counter() - started
        produced = policy_version + 1
        metrics = step_metrics(self.step, produced, self.skipped_steps, plan, sums, maxima, grad_norms, lr, elapsed)
        metrics["perf/dispatch_s"] = max(dispatch_s, 0.0)  # Ray round trips beyond the workers' compute
        metrics["perf/worker_cpu_s"] = worker_cpu_s  # CPU seconds of data-parallel rank 0 in its step calls
        return metrics

    def _call(
        self,
        method: str,
        batch: TrainingBatch,
        lengths: torch.Tensor,
        samples: list[int],
        per_token: dict[str, torch.Tensor] | None,
        current_version: int | None = None,
        apply: bool = True,
        temperature: float = 1.0,
    ) -> tuple[list[Any], list[list[int]], float]:
        """Deal `samples` to the DP ranks and call `method` on every worker; returns the answer of each
        DP rank, the rows each DP rank got, and the call's wall seconds. `apply` False: a training call
        measures and leaves the weights and the optimizer as they are (a zero-signal update). The workers'
        log-probs are of softmax(logits / `temperature`)."""
        plans = self.plan(lengths, samples)
        by_dp = []
        for plan in plans:
            sent = payload(batch, lengths, plan, per_token=per_token, current_version=current_version)
            sent["apply"] = apply
            sent["temperature"] = float(temperature)
            by_dp.append(sent)
        args = [by_dp[int(info["dp_rank"])] for info in self.ranks]
        started = time.perf_counter()
        answers = getattr(self._workers, method)(args)
        wall = time.perf_counter() - started
        parts = [flat_samples(plan) for plan in plans]
        return [answers[self._answering[dp]] for dp in range(self.dp_size)], parts, wall

    def plan(self, lengths: torch.Tensor, samples: list[int]) -> list[Plan]:
        """Each data-parallel rank's micro-batches for `samples`: the torch backend's packing
        (`packing.pack_samples`, with the same budget, row capacity and cost model) of the rank's share."""
        t = self.training

        def pack(rank_samples: list[int]) -> Plan:
            return pack_samples(
                lengths,
                rank_samples,
                token_budget=t.micro_batch_tokens,
                packed=self.packed,
                row_capacity=t.max_row_tokens,
                compute=self.compute_model,
            )

        return plan_ranks(samples, lengths, self.dp_size, pack)

    # ---------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainingBatch, temperature: float = 1.0) -> torch.Tensor:
        """The current policy's log-prob of every trained token (loss_mask 1), [N, L] on the CPU; 0 elsewhere;
        of softmax(logits / temperature) (1: the model's own, as an engine reports them)."""
        lengths = validate_batch(batch, self.vocab_size)
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        samples = list(range(batch.num_samples))
        answers, parts, _ = self._call("agl_logprobs", batch, lengths, samples, None, temperature=temperature)
        for rows, flat in zip(parts, answers, strict=True):
            scatter_logprobs(out, lengths, rows, flat)
        return out * (batch.loss_mask != 0)

    # ------------------------------------------------------------------------------------ weights
    def state_dict_for_engine(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The policy's full weights as CPU tensors under Hugging Face names, gathered from the FSDP
        shards (every rank takes part; rank 0's copy comes back); a tied output embedding appears once.
        With LoRA: base + adapter merged, under the base model's names, so any engine loads them."""
        arrays, entries = self._workers.agl_state_dict(dtype)[0]
        return WeightBuckets.from_wire(arrays, entries)

    def adapter_for_engine(self, dtype: torch.dtype | None = None) -> AdapterState:
        """The adapter alone (peft's names and config, CPU copies gathered from the shards): what an
        adapter-only sync moves."""
        if not self.uses_lora:
            raise ValueError("adapter_for_engine: this backend trains every weight (backend.lora.rank is 0)")
        return self._workers.agl_adapter(dtype)[0]

    def save_adapter(self, directory: str | Path) -> Path:
        """The bare adapter in peft's format (adapter_model.safetensors + adapter_config.json)."""
        if not self.uses_lora:
            raise ValueError("save_adapter: this backend trains every weight (backend.lora.rank is 0)")
        state = self.adapter_for_engine()
        directory = Path(directory)
        atomic_directory(directory, lambda tmp: write_adapter(state, tmp))
        return directory

    def save_hf(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """The policy as a Hugging Face directory (safetensors + config + the source's tokenizer files),
        loadable by transformers and vLLM. Written to a temporary sibling, then moved into place."""
        from huggingface_hub import save_torch_state_dict

        directory = Path(directory)
        state = self.state_dict_for_engine(dtype)
        source = Path(self.training.model_path)

        def write(tmp: Path) -> None:
            save_torch_state_dict(state, tmp)
            config = config_for_weights(json.loads((source / "config.json").read_text()), state)
            if dtype is not None:
                config["torch_dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            if (source / "generation_config.json").is_file():
                (tmp / "generation_config.json").write_bytes((source / "generation_config.json").read_bytes())
            copy_tokenizer_files(source, tmp)

        atomic_directory(directory, write)
        return directory

    # -------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path) -> Path:
        """verl's sharded checkpoint (model, optimizer, scheduler + RNG per rank) in verl/, and
        agl_state.json (step; the policy version is the loop's, in its own checkpoint). With LoRA the
        model shards hold the adapter only (the base is model_path's), and adapter/ the whole adapter
        in peft's format. Every node writes its ranks' shards into `directory`: on several nodes it
        must be a shared filesystem."""
        directory = Path(directory)
        adapter = self.adapter_for_engine() if self.uses_lora else None

        def write(tmp: Path) -> None:
            self._workers.agl_save_checkpoint(str((tmp / "verl").resolve()))
            if adapter is not None:
                write_adapter(adapter, tmp / CHECKPOINT_ADAPTER)
            state = {
                "format": 1,
                "step": self.step,
                "skipped_steps": self.skipped_steps,
                "world_size": self.config.world_size,
            }
            (tmp / CHECKPOINT_STATE).write_text(json.dumps(state))

        atomic_directory(directory, write)
        return directory

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what save_checkpoint wrote; the next train_step is then the one that would have followed."""
        directory = Path(directory)
        state_path = directory / CHECKPOINT_STATE
        if not state_path.is_file() or not (directory / "verl").is_dir():
            raise FileNotFoundError(
                f"{directory} is not an agl verl checkpoint (want verl/ and {CHECKPOINT_STATE}, as written "
                "by VerlBackend.save_checkpoint)"
            )
        state = json.loads(state_path.read_text())
        if int(state["world_size"]) != self.config.world_size:
            raise BackendConfigError(
                f"backend.verl.n_gpus_per_node: the checkpoint in {directory} has {state['world_size']} shards, "
                f"this run has {self.config.world_size} workers; resume with the same nnodes x n_gpus_per_node"
            )
        adapter_dir = directory / CHECKPOINT_ADAPTER
        lora.check_checkpoint_kind(directory, adapter_dir.is_dir(), self.uses_lora)
        if self.uses_lora:
            saved = read_adapter(adapter_dir)
            lora.check_same_adapter(self.ranks[0]["adapter_config"], saved.config)
        self._workers.agl_load_checkpoint(str((directory / "verl").resolve()))
        self.step = int(state["step"])  # older checkpoints also carry a policy_version: the loop's is used
        self.skipped_steps = int(state.get("skipped_steps", 0))

    # ------------------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop the workers, and Ray when this backend started it. Safe to call twice."""
        workers, self._workers = self._workers, None
        if workers is not None:
            cluster.stop_workers(workers)
        handle, self._ray = self._ray, None
        if handle is not None and handle.started_here:
            handle.shutdown()


def _dropout_off(model_path: Path) -> dict[str, float]:
    """HF config overrides turning dropout off (the engine sampled without it)."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {key: 0.0 for key in DROPOUT_KEYS if isinstance(config.get(key), int | float) and config[key] > 0}
