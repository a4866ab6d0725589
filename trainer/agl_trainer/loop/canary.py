"""The canary: after every weight sync, a few fixed probe sequences scored by the engine and by the
trainer, so a silent engine/trainer disagreement is named the step it happens.

Probes (token IDs drawn once from the run's seed):
- fixed: `probes` sequences scored by the engine's prompt logprobs (vLLM's `prompt_logprobs` on
  /v1/completions) and by the trainer under the new weights; the trainer's scores are kept, so the
  next sync also compares the engine with the weights before it.
- cached: one prefix the engine generated from at the previous check (its KV is in a prefix cache,
  if the engine keeps one), generated from again (greedy, with logprobs), the trainer scoring the
  generated tokens. Prompt logprobs do not read vLLM's prefix cache; generation does.
- fresh: a prefix never sent before, generated from the same way.

Several engine replicas: each check probes one, in turn (the check after a sync of version v asks
replica v mod n), so a replica whose weights did not land is named within n syncs at the cost of
one replica's probes; the replica is in the message and in `agreement/canary/replica`. The engine's
two questions go out at once (an engine batches them into the same steps) while the trainer scores
the fixed probes.

A disagreement above `tolerance` (mean |delta| in nats) gets a verdict:
- weights_not_loaded: the engine matches the previous weights, not the new ones;
- stale_cache: the cached probe disagrees while the fresh one and the fixed probes agree;
- numerics: a small drift spread over every token (a dtype mismatch);
- mismatch: none of these patterns.
`action: warn` logs the verdict with its fix; `stop` ends the run with it (CanaryStop).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agl_trainer.batch import RolloutResult, Sample, TrainingBatch
from agl_trainer.loop.ports import ProbeEngine

log = logging.getLogger("agl.canary")

VERDICTS = ("agree", "numerics", "stale_cache", "weights_not_loaded", "mismatch", "error")
NUMERICS_MAX = 1.0  # a drift, not a break: no token off by more than this many nats
NUMERICS_SPREAD = 0.2  # ...and the median token is off by at least this share of the mean
WEIGHTS_RATIO = 0.25  # the engine is this much nearer the previous weights than the new: not loaded
STALE_RATIO = 10.0  # a cached probe this many times further off than the fresh ones: old KV, not a bf16 wobble


class CanaryStop(RuntimeError):
    """The canary found a disagreement and diagnostics.canary.action is stop; the message names it."""


@dataclass(frozen=True)
class CanarySettings:
    action: str = "warn"  # warn | stop
    tolerance: float = 0.05  # mean |engine - trainer| in nats, per probe kind
    probes: int = 4
    tokens: int = 32  # tokens per probe
    generate: int = 1  # tokens the cached and fresh probes generate: the first is the one that reads the prefix's KV
    seed: int = 0


@dataclass(frozen=True)
class CanaryResult:
    version: int
    verdict: str
    message: str
    fixed: float  # mean |delta| of the fixed probes, new weights
    previous: float | None  # ...against the weights before the sync
    cached: float | None
    fresh: float | None
    max_delta: float
    seconds: float
    replica: int = 0  # which engine replica was probed (index into the engine's servers)

    def metrics(self) -> dict[str, float]:
        out = {
            "agreement/canary/replica": float(self.replica),
            "agreement/canary/mean_abs_delta": self.fixed,
            "agreement/canary/max_abs_delta": self.max_delta,
            "agreement/canary/ok": float(self.verdict == "agree"),
            "agreement/canary/verdict": float(VERDICTS.index(self.verdict)),
            "time/canary_s": self.seconds,
        }
        for name, value in (("previous", self.previous), ("cached", self.cached), ("fresh", self.fresh)):
            if value is not None:
                out[f"agreement/canary/{name}_mean_abs_delta"] = value
        return out


class Canary:
    """Scores the probes on one of `engines` (the engine's replicas, in turn: loop.ports.ProbeEngine,
    over HTTP in engines/probes.py) and with `backend.compute_logprobs`. Blocking: the loop runs it in
    a thread. `names`: how the message names each replica (its URL)."""

    def __init__(
        self,
        settings: CanarySettings,
        *,
        engines: Sequence[ProbeEngine],
        vocab_size: int,
        backend: Any,
        names: Sequence[str] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("the canary needs at least one engine replica to probe")
        self.settings = settings
        self.engines = list(engines)
        self.names = list(names) if names is not None else [f"replica {i}" for i in range(len(self.engines))]
        self.backend = backend
        self._ids = range(min(3, vocab_size - 1), vocab_size)  # the lowest ids are special in most tokenizers
        rng = random.Random(f"agl-canary-{settings.seed}")
        self.fixed = [self._draw(rng) for _ in range(settings.probes)]
        self.cached_prefix = self._draw(rng)
        self.previous: list[torch.Tensor] | None = None  # the trainer's scores of the fixed probes, last check

    # ------------------------------------------------------------------------------------- check
    def check(self, version: int) -> CanaryResult:
        """Score every probe now on one replica (the engine and the trainer both at `version`) and judge."""
        started = time.perf_counter()
        replica = version % len(self.engines)
        engine = self.engines[replica]
        fresh_prefix = self._draw(random.Random(f"agl-canary-{self.settings.seed}-fresh-{version}"))
        with ThreadPoolExecutor(2) as pool:  # both questions at once: the engine batches them
            fixed_scores = pool.submit(engine.prompt_logprobs, self.fixed)
            generated = pool.submit(engine.generate, [self.cached_prefix, fresh_prefix], self.settings.generate)
            trainer_fixed = self._trainer_scores([(probe, 1) for probe in self.fixed])  # meanwhile, the trainer's half
            try:
                engine_fixed = [torch.tensor(scores) for scores in fixed_scores.result()]
                (cached_tokens, cached_engine), (fresh_tokens, fresh_engine) = generated.result()
            except Exception as error:  # an engine that cannot score is reported, never a crash of the run
                return self._result(
                    version, "error", f"{self.names[replica]} could not score the probes: {error}", started, replica
                )
        cached_ids, fresh_ids = self.cached_prefix + cached_tokens, fresh_prefix + fresh_tokens
        trainer_cached, trainer_fresh = self._trainer_scores(
            [(cached_ids, len(self.cached_prefix)), (fresh_ids, len(fresh_prefix))]
        )
        fixed = torch.cat([(e - t).abs() for e, t in zip(engine_fixed, trainer_fixed, strict=True)])
        previous = None
        if self.previous is not None:
            previous = torch.cat([(e - t).abs() for e, t in zip(engine_fixed, self.previous, strict=True)])
        self.previous = trainer_fixed
        cached = (torch.tensor(cached_engine) - trainer_cached).abs()
        fresh = (torch.tensor(fresh_engine) - trainer_fresh).abs()
        verdict, message = judge(fixed, previous, cached, fresh, self.settings.tolerance)
        if len(self.engines) > 1:
            message = f"{self.names[replica]}: {message}"
        every = torch.cat([fixed, cached, fresh])
        return CanaryResult(
            version=version,
            verdict=verdict,
            message=message,
            fixed=float(fixed.mean()),
            previous=None if previous is None else float(previous.mean()),
            cached=float(cached.mean()) if cached.numel() else None,
            fresh=float(fresh.mean()) if fresh.numel() else None,
            max_delta=float(every.max()) if every.numel() else 0.0,
            seconds=time.perf_counter() - started,
            replica=replica,
        )

    def _draw(self, rng: random.Random) -> list[int]:
        return [rng.choice(self._ids) for _ in range(self.settings.tokens)]

    def _result(self, version: int, verdict: str, message: str, started: float, replica: int) -> CanaryResult:
        return CanaryResult(
            version, verdict, message, 0.0, None, None, None, 0.0, time.perf_counter() - started, replica
        )

    # ----------------------------------------------------------------------------------- trainer
    def _trainer_scores(self, sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """The trainer's logprob of each sequence's tokens from `start` on, under its current weights."""
        rollouts = []
        for index, (ids, start) in enumerate(sequences):
            n = len(ids)
            mask = np.arange(n) >= start
            sample = Sample(f"canary-{index}", "canary", ids, mask, np.zeros(n, np.float32), np.full(n, -1, np.int64))
            rollouts.append(RolloutResult(f"canary-{index}", "canary", 0.0, [sample]))
        batch = TrainingBatch.from_rollouts(rollouts)
        scores = self.backend.compute_logprobs(batch)
        return [scores[row, start : len(ids)].float() for row, (ids, start) in enumerate(sequences)]


def judge(
    fixed: torch.Tensor,
    previous: torch.Tensor | None,
    cached: torch.Tensor,
    fresh: torch.Tensor,
    tolerance: float,
) -> tuple[str, str]:
    """The verdict on per-token |delta|s, and its message with the fix."""

    def mean(x: torch.Tensor | None) -> float:
        return float(x.mean()) if x is not None and x.numel() else 0.0

    m_fixed, m_cached, m_fresh = mean(fixed), mean(cached), mean(fresh)
    if max(m_fixed, m_cached, m_fresh) <= tolerance:
        return "agree", f"engine and trainer agree (mean |delta| {m_fixed:.2g} <= tolerance {tolerance:g})"
    if previous is not None and mean(previous) < WEIGHTS_RATIO * m_fixed:  # nearer the old weights
        return "weights_not_loaded", (
            f"the weights did not land: the engine's logprobs of the probes match the previous weights "
            f"(mean |delta| {mean(previous):.2g}), not the new ones ({m_fixed:.2g}). Fix: check the engine's "
            "weight update (its log; for vLLM the worker extension and engine.options), and that the "
            "engine serves the model being trained"
        )
    off_fresh = max(m_fresh, m_fixed)
    if m_cached > tolerance and off_fresh <= tolerance and m_cached > STALE_RATIO * off_fresh:
        return "stale_cache", (
            f"stale prefix cache: a probe whose prefix the engine cached before the update disagrees "
            f"(mean |delta| {m_cached:.2g}) while a fresh probe agrees ({m_fresh:.2g}): the engine reuses KV "
            "computed by the old weights. Fix: reset the engine's prefix cache after each weight update "
            "(vLLM: POST /reset_prefix_cache, which agl's vLLM engine sends), or start vLLM with "
            "--no-enable-prefix-caching"
        )
    every = torch.cat([fixed, cached, fresh])
    if float(every.max()) <= NUMERICS_MAX and float(every.median()) >= NUMERICS_SPREAD * float(every.mean()):
        return "numerics", (
            f"every probe drifts a little (mean |delta| {float(every.mean()):.2g}, max "
            f"{float(every.max()):.2g}): the engine and the trainer compute in different precision. Fix: run "
            "both in the same dtype (the engine's dtype, backend.options param_dtype / compute_dtype), or set "
            "diagnostics.canary.tolerance above this drift if it is expected (bfloat16 against float32)"
        )
    return "mismatch", (
        f"the engine and the trainer disagree (mean |delta| {m_fixed:.2g}, max {float(every.max()):.2g}) in no "
        "pattern the canary knows. Fix: check that the engine serves the trained model (same checkpoint, "
        "tokenizer and architecture) and that its weight updates complete"
    )
