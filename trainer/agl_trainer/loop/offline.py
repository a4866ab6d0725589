"""`agl train CONFIG --from-store traces.db`: train on rollouts collected earlier, off-policy.

Production harnesses call the model through a sidecar and report rewards with `agl.emit_reward()`;
`agl receive --store traces.db` (or an agl train run) keeps their rollouts. This trains on them
without running any harness or engine:

    end      a rollout without an end span (no agl.rollout around the harness) once it is quiet for
             offline.quiet_s
    select   complete, untrained rollouts of mode train with a reward, oldest first; drop (and record
             why) those that failed, are older than offline.max_age_s, or whose calls lag more than
             offline.max_policy_lag versions behind the newest in the store
    group    by task id (the GRPO group), groups of loop.group_size at most, offline.min_group_size
             at least (a task with fewer waits for more data)
    train    loop.batch_rollouts a step. Every token was sampled by the policy that served it, not by
             the weights being trained, so each counts as stale: truncated importance weights
             min(exp(old - engine), backend.algorithm.importance_cap) against the recorded engine
             logprobs
    record   at each checkpoint the step's rollouts are marked trained in the store (and in
             OUTPUT_DIR/trained.jsonl), so a second run, or --resume, continues where this one
             stopped and never trains a rollout twice

The store is opened beside a running `agl receive` (SQLite WAL): new rollouts keep arriving; the
next step picks them up, reading only what changed since the last (store_cursor.py), and so does
the next run.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_trainer.config import Config, ConfigError, dump_config
from agl_trainer.loop.checkpoint import RUN_FILE, Checkpoints, LoopState, open_run_dir
from agl_trainer.loop.store_cursor import StoreCursor
from agl_trainer.store import Cause, RolloutKey, RolloutStore
from agl_trainer.store.records import RolloutInfo


@dataclass
class OfflineSummary:
    steps: int
    trained: int
    dropped: dict[str, int] = field(default_factory=dict)
    waiting: int = 0  # ready rollouts left for a later run (a group too small, no reward yet)
    history: list[dict[str, float]] = field(default_factory=list)
    output_dir: Path | None = None
    checkpoint: Path | None = None


@dataclass
class Selection:
    groups: list[list[RolloutKey]]
    dropped: dict[str, list[RolloutKey]]
    waiting: int


def select(
    infos: list[RolloutInfo],
    min_versions: dict[RolloutKey, int],
    *,
    group_size: int,
    min_group_size: int,
    max_policy_lag: int,
    max_age_s: float,
    now: float,
    newest: int | None = None,
) -> Selection:
    """Which ready rollouts to train (as groups, oldest first), which to drop and why, how many wait.
    `newest`: the newest of min_versions when the caller keeps it (else computed here)."""
    dropped: dict[str, list[RolloutKey]] = defaultdict(list)
    if newest is None:
        newest = max(min_versions.values(), default=0)
    by_task: dict[str, list[RolloutKey]] = defaultdict(list)
    waiting = 0
    ok = (None, Cause.OK.value)
    for info in infos:
        key = info.key
        if info.end_cause not in ok:
            dropped["failed"].append(key)
        elif max_age_s > 0 and (info.completed_at or info.last_span_at) < now - max_age_s:
            dropped["too_old"].append(key)
        elif max_policy_lag >= 0 and newest - min_versions.get(key, newest) > max_policy_lag:
            dropped["stale"].append(key)
        elif info.rewards == 0 or info.calls == 0:
            waiting += 1  # a reward (or the calls) may still arrive
        else:
            by_task[info.task_id or info.rollout_id].append(key)
    groups: list[list[RolloutKey]] = []
    for keys in by_task.values():
        for start in range(0, len(keys), group_size):
            chunk = keys[start : start + group_size]
            if len(chunk) >= min_group_size:
                groups.append(chunk)
            else:
                waiting += len(chunk)
    return Selection(groups, dict(dropped), waiting)


class OfflineTrainer:
    def __init__(self, config: Config, store_path: str | Path, *, resume: bool = False, quiet: bool = False) -> None:
        self.config = config
        self.store_path = Path(store_path)
        self.resume = resume
        self.quiet = quiet
        self.output_dir = Path(config.output_dir)

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def run(self) -> OfflineSummary:
        with contextlib.ExitStack() as stack:
            return self._run(stack)

    def _run(self, stack: contextlib.ExitStack) -> OfflineSummary:
        config, out = self.config, self.output_dir
        if not self.store_path.is_file():
            raise ConfigError(
                f"--from-store {self.store_path}: no such rollout store (fix: the file `agl receive --store` wrote)"
            )
        checkpoints, latest = open_run_dir(out, self.resume)
        (out / "config.yaml").write_text(dump_config(config))
        import torch

        from agl_trainer.loop.session import _pad_token_id, build_backend

        torch.manual_seed(config.seed)
        # Late spans are what offline.quiet_s waits for: a rollout that ended is ready at once.
        store = RolloutStore(self.store_path, grace_s=0.0)
        stack.callback(store.close)
        backend = build_backend(config, str(config.model.path))
        close_backend = getattr(backend, "close", None)
        if close_backend is not None:
            stack.callback(close_backend)
        state = LoopState(run_id=self._run_id(out))
        if latest is not None:
            state = checkpoints.load(latest)
            backend.load_checkpoint(latest / "backend")
            if state.trained_since_previous:  # the crash came between the checkpoint and the marks
                store.mark_trained([RolloutKey(r, a) for r, a in state.trained_since_previous], state.step)
        (out / RUN_FILE).write_text(json.dumps({"run_id": state.run_id, "from_store": str(self.store_path)}))
        from agl_trainer.loop.dataplane import StoreDataPlane
        from agl_trainer.metrics import MetricsWriter

        data = StoreDataPlane(store, config.assembly)
        metrics = MetricsWriter(out)
        stack.callback(metrics.close)
        pad = _pad_token_id(str(config.model.path))
        summary = OfflineSummary(steps=0, trained=0, output_dir=out)
        pending: list[RolloutKey] = []  # trained since the last checkpoint
        started = time.monotonic()
        loop = config.loop
        reader = StoreCursor(store, self.store_path)  # a step reads only what changed since the last
        while state.step < loop.max_steps:
            if loop.max_train_s and time.monotonic() - started > loop.max_train_s:
                break
            batch, waiting = self._next_batch(reader, data, summary)
            summary.waiting = waiting
            if not batch:
                break
            row = self._train(batch, data, backend, pad, state)
            state.step += 1
            state.policy_version += 1
            pending += batch
            summary.steps += 1
            summary.trained += len(batch)
            summary.history.append(row)
            metrics.write(state.step, row)
            self._say(
                f"agl: offline step {state.step}: {len(batch)} rollouts, reward {row.get('reward/mean', float('nan')):.3f}"
            )
            if state.step % loop.checkpoint_every == 0:
                summary.checkpoint = self._checkpoint(checkpoints, state, backend, store, pending)
                pending = []
        if pending:
            summary.checkpoint = self._checkpoint(checkpoints, state, backend, store, pending)
        elif latest is not None and summary.checkpoint is None:
            summary.checkpoint = latest
        return summary

    def _next_batch(
        self, reader: StoreCursor, data: Any, summary: OfflineSummary
    ) -> tuple[list[RolloutKey], int]:
        """The next step's rollouts and how many wait; the reader reads only what changed (store_cursor.py)."""
        config = self.config
        infos = reader.refresh(config.offline.quiet_s, time.time())
        selection = select(
            infos,
            reader.min_versions,
            group_size=config.loop.group_size,
            min_group_size=config.offline.min_group_size,
            max_policy_lag=config.offline.max_policy_lag,
            max_age_s=config.offline.max_age_s,
            now=time.time(),
            newest=reader.newest,
        )
        for reason, keys in selection.dropped.items():
            data.mark_dropped(keys, reason)  # recorded: the next run does not look at them again
            reader.forget(keys)
            summary.dropped[reason] = summary.dropped.get(reason, 0) + len(keys)
        batch: list[RolloutKey] = []
        for group in selection.groups:
            if len(batch) + len(group) > config.loop.batch_rollouts and batch:
                break
            batch += group
        reader.forget(batch)
        return batch, selection.waiting

    def _train(self, keys: list[RolloutKey], data: Any, backend: Any, pad: int, state: LoopState) -> dict[str, float]:
        from agl_trainer.batch import TrainingBatch
        from agl_trainer.loop.core import _batch_metrics, _reward_metrics

        started = time.monotonic()
        assembled = data.assemble(keys)
        results = [r for r in assembled.results if r.samples]
        row: dict[str, float] = {f"assembly/{k}": v for k, v in assembled.report.items()}
        row["rollouts/trained"] = float(len(results))
        if results:
            batch = TrainingBatch.from_rollouts(results, pad)
            trained = batch.policy_versions[batch.loss_mask > 0]
            # Newer than every recorded version: each token is importance-corrected against the engine's logprobs.
            version = int(trained.max()) + 1 if trained.numel() else state.policy_version
            row.update({k: float(v) for k, v in backend.train_step(batch, version).items() if _is_number(v)})
            row.update(_batch_metrics(batch, version))
            row.update(_reward_metrics([r.reward for r in results]))
        row["time/step_s"] = time.monotonic() - started
        row["policy_version"] = float(state.policy_version + 1)
        return row

    def _checkpoint(
        self, checkpoints: Checkpoints, state: LoopState, backend: Any, store: RolloutStore, keys: list[RolloutKey]
    ) -> Path:
        state.trained_since_previous = [(k.rollout_id, k.attempt) for k in keys]
        path = checkpoints.save(state, backend)
        # Only now, with weights that include them on disk, do these count as trained.
        store.mark_trained(keys, state.step)
        checkpoints.record_trained(state.step, keys)
        return path

    def _run_id(self, out: Path) -> str:
        path = out / RUN_FILE
        if path.exists():
            return str(json.loads(path.read_text())["run_id"])
        return secrets.token_hex(3)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or hasattr(value, "item")


def train_from_store(config: Config, store_path: str | Path, *, resume: bool = False, quiet: bool = False) -> OfflineSummary:
    return OfflineTrainer(config, store_path, resume=resume, quiet=quiet).run()
