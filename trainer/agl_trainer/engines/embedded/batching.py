"""Continuous batching for the embedded engine: many sequences, one forward pass per step.

A `BatchScheduler` owns a transformers causal LM and a thread. Sequences submitted from any
thread join the running batch at the next step: they are prefilled together (left-padded), their
KV cache is padded and stacked onto the batch's cache, and from then on every step feeds all live
sequences' last tokens through the model once. Finished sequences leave the batch at once. Weights
are swapped under `weights_lock`, which the thread holds for each step, so an update lands between
steps and never inside one.

`freeze()` stops scheduling (a drain-free policy switch, loop.switch: keep): the sequences in the
batch keep their tokens and KV cache and wait; `thaw()` continues them, under whatever weights are
loaded by then. Their KV cache of the prefix was computed by the old weights, which the new weights
then attend to (vLLM's `pause?mode=keep` does the same).

Sampling is per sequence and reproducible: each sequence draws its uniforms from its own
`torch.Generator` (seeded by the request's `seed`), so a sequence's tokens do not depend on what
else is in the batch. Returned logprobs are the model's raw log-softmax (before temperature, top-p
and top-k), as vLLM's default `logprobs_mode=raw_logprobs` returns them.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agl_trainer.config_schema import GREEDY_BELOW  # temperatures below it sample greedily, as vLLM does


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob plus the top k
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Sequence:
    """One generated choice. The scheduler thread appends to it; `on_update` hands it to a reader."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    sink: Any = None  # the reader's handle (the server keeps its asyncio queue here)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str | None = None  # the output text cut before a matched stop string
    request_id: str = ""  # the engine request id, for freeze()'s progress report
    cancelled: bool = False  # set by the reader (client gone): the sequence leaves at the next step
    _uniforms: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# (sequences that got a token or finished this step, for each: how many tokens it had then)
UpdateHook = Callable[[list[tuple[Sequence, int, bool]]], None]


class BatchScheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_model_len: int,
        on_update: UpdateHook,
        max_batch_size: int = 256,
        device_step_s: float = 0.0,
    ) -> None:
        self.model = model
        self.device_step_s = device_step_s  # simulated accelerator time per step (EmbeddedOptions.device_step_ms)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.on_update = on_update
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.weights_lock = threading.RLock()
        self.steps = 0
        self.busy_s = 0.0
        self._pending: list[Sequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._frozen = False
        self._thread = threading.Thread(target=self._run, name="agl-embedded-engine", daemon=True)
        # the running batch
        self._live: list[Sequence] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._next: torch.Tensor | None = None  # [B] tokens sampled but not yet fed

    # --- control ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._abort_unfinished()

    def _abort_unfinished(self) -> None:
        """The engine stops: whatever still generates, frozen or waiting, ends as aborted, so that
        no request handler waits for a token that will never come."""
        with self._cond:
            sequences, self._pending = [*self._live, *self._pending], []
        self._live, self._cache, self._mask, self._next = [], None, None, None
        updates = []
        for sequence in sequences:
            if not sequence.finished:
                sequence.finish_reason = "abort"
                updates.append((sequence, len(sequence.token_ids), True))
        if updates:
            self.on_update(updates)

    def freeze(self) -> dict[str, int]:
        """Stop scheduling after the step under way; returns each unfinished sequence's tokens so
        far (by request id): where the next policy version will start in it."""
        with self._cond:
            self._frozen = True
        with self.weights_lock:  # the step under way (the thread holds the lock for it) is over
            with self._cond:
                return {s.request_id: len(s.token_ids) for s in [*self._live, *self._pending] if not s.finished}

    def thaw(self) -> None:
        """Continue the frozen sequences (and admit the waiting ones)."""
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    @property
    def frozen(self) -> bool:
        return self._frozen

    def progress(self) -> dict[str, int]:
        """Each unfinished sequence's tokens so far, by request id (a snapshot; the batch moves on)."""
        with self._cond:
            return {s.request_id: len(s.token_ids) for s in [*self._live, *self._pending] if not s.finished}

    def submit(self, sequences: list[Sequence]) -> None:
        for sequence in sequences:
            if sequence.params.seed is None:
                generator = torch.Generator().manual_seed(random.getrandbits(63))
            else:
                generator = torch.Generator().manual_seed(sequence.params.seed)
            sequence._uniforms = torch.rand(
                sequence.params.max_tokens, generator=generator, dtype=torch.float64
            )
        with self._cond:
            self._pending.extend(sequences)
            self._cond.notify_all()

    # --- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while (self._frozen or (not self._pending and not self._live)) and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                room = self.max_batch_size - len(self._live)
                admitted, self._pending = self._pending[:room], self._pending[room:]
            started = time.perf_counter()
            try:
                with self.weights_lock, torch.inference_mode():
                    if self._frozen:  # frozen between taking `admitted` and the lock: no step
                        with self._cond:
                            self._pending[:0] = admitted
                        continue
                    self._step(admitted)
            except Exception as error:  # noqa: BLE001 (a failed step fails its sequences, never the thread)
                self._fail_all(admitted, error)
            if self.device_step_s:
                time.sleep(self.device_step_s)
            self.busy_s += time.perf_counter() - started
            self.steps += 1

    def _fail_all(self, admitted: list[Sequence], error: Exception) -> None:
        updates = []
        for sequence in [*self._live, *admitted]:
            if not sequence.finished:
                sequence.stop_reason = f"{type(error).__name__}: {error}"
                sequence.finish_reason = "error"
                updates.append((sequence, len(sequence.token_ids), True))
        self._live, self._cache, self._mask, self._next = [], None, None, None
        self.on_update(updates)

    def _step(self, admitted: list[Sequence]) -> None:
        updates: list[tuple[Sequence, int, bool]] = []
        for sequence in [*self._live, *admitted]:
            if sequence.cancelled and not sequence.finished:
                sequence.finish_reason = "abort"
        admitted = [s for s in admitted if not s.finished]
        self._drop_finished()
        if self._live:  # feed every live sequence's last token
            mask = torch.cat([self._mask, torch.ones(len(self._live), 1, dtype=self._mask.dtype)], dim=1)
            positions = mask.sum(dim=1, keepdim=True) - 1
            device = self._device()
            out = self.model(
                input_ids=self._next[:, None].to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
            self._mask = mask
            self._next = self._sample(self._live, out.logits[:, -1, :].cpu(), updates)
        if admitted:
            self._admit(admitted, updates)
        self._drop_finished()
        if updates:
            self.on_update(updates)

    def _admit(self, admitted: list[Sequence], updates: list[tuple[Sequence, int, bool]]) -> None:
        from transformers import DynamicCache

        width = max(len(s.prompt_ids) for s in admitted)
        ids = torch.full((len(admitted), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(admitted), width), dtype=torch.long)
        for row, sequence in enumerate(admitted):
            n = len(sequence.prompt_ids)
            ids[row, width - n :] = torch.tensor(sequence.prompt_ids, dtype=torch.long)
            mask[row, width - n :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        device = self._device()
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        first = self._sample(admitted, out.logits[:, -1, :].cpu(), updates)
        if not self._live:
            self._live, self._cache, self._mask, self._next = list(admitted), cache, mask, first
            return
        # stack the newcomers under the running batch, left-padding the shorter KV history
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([_pad_left(old_layer.keys, width), _pad_left(new_layer.keys, width)])
            old_layer.values = torch.cat(
                [_pad_left(old_layer.values, width), _pad_left(new_layer.values, width)]
            )
        self._mask = torch.cat([_pad_left_2d(self._mask, width), _pad_left_2d(mask, width)])
        self._next = torch.cat([self._next, first])
        self._live.extend(admitted)

    def _device(self) -> torch.device:
        """Where the model runs (EmbeddedOptions.device); the KV cache lives there too."""
        return next(self.model.parameters()).device

    def _drop_finished(self) -> None:
        keep = [row for row, sequence in enumerate(self._live) if not sequence.finished]
        if len(keep) == len(self._live):
            return
        if not keep:
            self._live, self._cache, self._mask, self._next = [], None, None, None
            return
        index = torch.tensor(keep, dtype=torch.long)
        self._live = [self._live[row] for row in keep]
        self._mask, self._next = self._mask[index], self._next[index]
        first_used = int(self._mask.any(dim=0).to(torch.int8).argmax())  # drop all-padding columns
        on_device = index.to(self._device())
        for layer in self._cache.layers:
            layer.keys = layer.keys[on_device, :, first_used:]
            layer.values = layer.values[on_device, :, first_used:]
        self._mask = self._mask[:, first_used:]

    # --- sampling --------------------------------------------------------------------------------
    def _sample(
        self, rows: list[Sequence], logits: torch.Tensor, updates: list[tuple[Sequence, int, bool]]
    ) -> torch.Tensor:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        chosen = self._choose(rows, logits)
        picked = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        want_top = max((s.params.logprobs or 0) for s in rows)
        top_values = top_ids = None
        if want_top:
            top = torch.topk(raw_logprobs, k=min(want_top, logits.shape[-1]), dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        tokens = chosen.tolist()
        for row, sequence in enumerate(rows):
            token = tokens[row]
            sequence.token_ids.append(token)
            sequence.logprobs.append(picked[row])
            if sequence.params.logprobs is not None:
                k = sequence.params.logprobs
                sequence.top_logprobs.append(
                    list(zip(top_ids[row][:k], top_values[row][:k])) if k and top_ids is not None else []
                )
            self._check_finished(sequence, token)
            if sequence.stream or sequence.finished:
                updates.append((sequence, len(sequence.token_ids), sequence.finished))
        return chosen

    def _choose(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        if any(s.params.logit_bias for s in rows):
            logits = logits.clone()
            for row, sequence in enumerate(rows):
                for token, bias in sequence.params.logit_bias:
                    logits[row, token] += bias
        greedy_rows = [s.params.temperature < GREEDY_BELOW for s in rows]
        greedy = logits.argmax(dim=-1)
        if all(greedy_rows):
            return greedy
        temperature = torch.tensor([max(s.params.temperature, GREEDY_BELOW) for s in rows])[:, None]
        scaled = logits / temperature
        top_k = [s.params.top_k for s in rows]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[-1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        top_p = [s.params.top_p for s in rows]
        if any(p < 1.0 for p in top_p):
            order = scaled.sort(dim=-1, descending=True)
            probs_sorted = torch.softmax(order.values, dim=-1)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly above each token
            drop_sorted = before > torch.tensor(top_p)[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order.indices, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
        steps = [len(s.token_ids) for s in rows]
        uniforms = torch.stack([s._uniforms[step] for s, step in zip(rows, steps)])[:, None]
        sampled = (cdf <= uniforms * cdf[:, -1:]).sum(dim=-1).clamp(max=logits.shape[-1] - 1)
        return torch.where(torch.tensor(greedy_rows), greedy, sampled)

    def _check_finished(self, sequence: Sequence, token: int) -> None:
        params = sequence.params
        if token in self.eos_ids and not params.ignore_eos:
            sequence.finish_reason = "stop"
        elif token in params.stop_token_ids:
            sequence.stop_reason = token
            sequence.finish_reason = "stop"  # last: readers on other threads key on it
        elif params.stop and self._match_stop(sequence):
            pass
        elif (
            len(sequence.token_ids) >= params.max_tokens
            or len(sequence.prompt_ids) + len(sequence.token_ids) >= self.max_model_len
        ):
            sequence.finish_reason = "length"

    def _match_stop(self, sequence: Sequence) -> bool:
        text = self.tokenizer.decode(
            sequence.token_ids, skip_special_tokens=sequence.params.skip_special_tokens
        )
        found = [(text.find(stop), stop) for stop in sequence.params.stop if stop in text]
        if not found:
            return False
        at, stop = min(found)
        sequence.stop_reason, sequence.stop_text = stop, text[:at]
        sequence.finish_reason = "stop"  # last: readers on other threads key on it
        return True


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return frozenset(ids)


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[-2]
    return torch.nn.functional.pad(tensor, (0, 0, missing, 0)) if missing else tensor


def _pad_left_2d(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return torch.nn.functional.pad(mask, (missing, 0)) if missing else mask
