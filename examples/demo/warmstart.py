"""A short supervised warm start: fit a model to demonstrations before RL, as its own phase.

    from examples.demo.warmstart import Demonstration, WarmStartConfig, supervised_warm_start

    result = supervised_warm_start("runs/demo/model-init", "runs/demo/model-warm", demonstrations,
                                   WarmStartConfig(steps=60, lr=1e-3))
    result.path, result.losses, result.seconds

A demonstration is a token sequence and a mask of the positions to learn (the assistant's
tokens); the loss is the mean cross-entropy over masked positions of a random minibatch, AdamW,
a rich progress bar per step. The result is saved with save_pretrained (model and tokenizer), so
any engine loads it by path. A tiny model from random weights does not learn the demo task by RL
alone (ENVIRONMENT.md); a few dozen steps on demonstrations is enough to start RL from ~0.45.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class Demonstration:
    token_ids: list[int]
    loss_mask: list[int]  # 1 where the model should learn to produce token_ids[t]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask):
            raise ValueError(
                f"Demonstration: token_ids ({len(self.token_ids)}) and loss_mask ({len(self.loss_mask)}) "
                "must have the same length"
            )
        if not any(self.loss_mask[1:]):
            raise ValueError("Demonstration: loss_mask marks no position after the first; nothing to learn")


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 60
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 0.0
    seed: int = 0
    # process-wide torch.set_num_threads; 1 suits tiny models (see engines/embedded/engine.py); None: leave it
    torch_threads: int | None = 1
    # constant: `lr` throughout; cosine: `lr` after `warmup_steps` of linear rise, then down to 0 at the
    # last step, so the saved weights are where the steps settled, not one noisy step of a constant rate
    schedule: str = "constant"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"WarmStartConfig.{key} must be >= 1, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ValueError(f"WarmStartConfig.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"WarmStartConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"WarmStartConfig.warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return self.lr
        done = (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * done))


@dataclass
class WarmStartResult:
    path: Path
    seconds: float
    losses: list[float] = field(default_factory=list)


def supervised_warm_start(
    model_path: str | Path,
    output_dir: str | Path,
    demonstrations: Sequence[Demonstration],
    config: WarmStartConfig = WarmStartConfig(),
    *,
    progress: bool = True,
) -> WarmStartResult:
    """Train `model_path` on `demonstrations` for `config.steps` steps and save it to `output_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not demonstrations:
        raise ValueError("supervised_warm_start: no demonstrations given")
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask, attention = _pad(demonstrations, pad)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    with _progress(progress, config.steps) as advance:
        for step in range(config.steps):
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            rows = torch.randint(
                0, len(demonstrations), (min(config.batch_size, len(demonstrations)),), generator=generator
            )
            loss = _loss(model, ids[rows], mask[rows], attention[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            advance(losses[-1])
    model.eval()
    seconds = time.perf_counter() - started
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from agl_trainer.models.hf_progress import quiet_progress

    with quiet_progress():  # the warm start's own bar above says what happened
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return WarmStartResult(path=out, seconds=seconds, losses=losses)


def _pad(demonstrations: Sequence[Demonstration], pad: int):  # -> (ids, loss mask, attention) [N, L]
    import torch

    width = max(len(d.token_ids) for d in demonstrations)
    ids = torch.full((len(demonstrations), width), pad, dtype=torch.long)
    mask = torch.zeros((len(demonstrations), width), dtype=torch.float32)
    attention = torch.zeros((len(demonstrations), width), dtype=torch.long)
    for row, demo in enumerate(demonstrations):
        n = len(demo.token_ids)
        ids[row, :n] = torch.as_tensor(demo.token_ids)
        mask[row, :n] = torch.as_tensor(demo.loss_mask, dtype=torch.float32)
        attention[row, :n] = 1
    return ids, mask, attention


def _loss(model, ids, mask, attention):
    import torch

    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    targets, weights = ids[:, 1:], mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * weights).sum() / weights.sum().clamp(min=1)


class _progress:
    """A rich progress bar with the current loss, or nothing when disabled."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda loss: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("warm start"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self._bar.start()
        task = self._bar.add_task("warm start", total=self.total, loss="-")
        return lambda loss: self._bar.update(task, advance=1, loss=f"{loss:.3f}")

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.stop()
