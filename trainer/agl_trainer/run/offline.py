"""`agl train CONFIG --from-store traces.db`: train on rollouts collected earlier, off-policy.

Production harnesses call the model through a sidecar and report rewards with `agl.emit_reward()`;
`agl receive --store traces.db` (or an agl train run) keeps their rollouts. This trains on them
without running any harness or engine:

    end      a rollout without an end span (no agl.rollout around the harness) once it is quiet for
             offline.quiet_s
    select   complete, untrained rollouts of mode train with a reward, oldest first; drop (and record
             why) those that failed, are older than offline.max_age_s, or whose calls lag more than
             offline.max_policy_lag versions behind the weights being trained (this run's policy
             version: offline.policy_version, the version the store gives model.path's weights, plus
             the steps taken); skip, unrecorded, those whose calls say a newer version (a later run
             may reach it)
    group    by task id (the GRPO group), groups of loop.group_size at most, offline.min_group_size
             at least (a task with fewer waits for more data)
    check    a rollout the model cannot take (a non-finite reward, a token outside the vocabulary) is
             set aside with its reason, recorded (offline_checks.py); the rest of the step trains
    train    loop.batch_rollouts a step. A token sampled by an older version than the weights being
             trained is stale: truncated importance weights min(exp(old - engine),
             backend.algorithm.importance_cap) against the recorded engine logprobs; staleness/* is
             measured against this run's version
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
from agl_trainer.run.offline_checks import VERSION_AHEAD, split
from agl_trainer.store.cursor import StoreCursor
from agl_trainer.store import Cause, RolloutKey, RolloutStore
from agl_trainer.store.records import RolloutInfo


@dataclass
class OfflineSummary:
    steps: int
    trained: int
    dropped: dict[str, int] = field(default_factory=dict)
    waiting: int = 0  # ready rollouts left for a later run (a group too small, no reward yet)
    ahead: int = 0  # skipped: their calls say a newer policy version than the weights trained
    history: list[dict[str, float]] = field(default_factory=list)
    output_dir: Path | None = None
    checkpoint: Path | None = None


@dataclass
class Selection:
    groups: list[list[RolloutKey]]
    dropped: dict[str, list[RolloutKey]]
    waiting: int
    ahead: list[RolloutKey] = field(default_factory=list)  # newer than `current`: not recorded


def select(
    infos: list[RolloutInfo],
    min_versions: dict[RolloutKey, int],
    *,
    group_size: int,
    min_group_size: int,
    max_policy_lag: int,
    max_age_s: float,
    now: float,
    current: int,
    max_versions: dict[RolloutKey, int] | None = None,
) -> Selection:
    """Which ready rollouts to train (as groups, oldest first), which to drop and why, how many wait.
    `current`: the policy version of the weights being trained; a rollout's lag is current minus its
    oldest call's version (min_versions). One whose newest call (max_versions) is ahead of current
    is skipped, not recorded: one hostile version number never makes the others stale."""
    dropped: dict[str, list[RolloutKey]] = defaultdict(list)
    ahead: list[RolloutKey] = []
    by_task: dict[str, list[RolloutKey]] = defaultdict(list)
    waiting = 0
    ok = (None, Cause.OK.value)
    for info in infos:
        key = info.key
        if info.end_cause not in ok:
            dropped["failed"].append(key)
        elif max_age_s > 0 and (info.completed_at or info.last_span_at) < now - max_age_s:
            dropped["too_old"].append(key)
        elif (max_versions or {}).get(key, min_versions.get(key, current)) > current:
            ahead.append(key)
        elif max_policy_lag >= 0 and current - min_versions.get(key, current) > max_policy_lag:
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
    return Selection(groups, dict(dropped), waiting, ahead)


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

        from agl_trainer.run.build import build_backend, pad_token_id

        torch.manual_seed(config.seed)
        # Late spans are what offline.quiet_s waits for: a rollout that ended is ready at once.
        store = RolloutStore(self.store_path, grace_s=0.0)
        stack.callback(store.close)
        backend = build_backend(config, str(config.model.path))
        stack.callback(backend.close)
        state = LoopState(run_id=self._run_id(out))
        if latest is not None:
            state = checkpoints.load(latest)
            backend.load_checkpoint(latest / "backend")
            if state.trained_since_previous:  # the crash came between the checkpoint and the marks
                store.mark_trained([RolloutKey(r, a) for r, a in state.trained_since_previous], state.step)
        (out / RUN_FILE).write_text(json.dumps({"run_id": state.run_id, "from_store": str(self.store_path)}))
        from agl_trainer.run.dataplane import StoreDataPlane
        from agl_trainer.metrics import MetricsWriter

        data = StoreDataPlane(store, config.assembly)
        from agl_trainer.metrics.trackers import start_trackers

        metrics = MetricsWriter(out, trackers=start_trackers(config, out, kind="train"))
        stack.callback(metrics.close)
        pad = pad_token_id(str(config.model.path))
        summary = OfflineSummary(steps=0, trained=0, output_dir=out)
        pending: list[RolloutKey] = []  # trained since the last checkpoint
        started = time.monotonic()
        loop = config.loop
        reader = StoreCursor(store, self.store_path)  # a step reads only what changed since the last
        vocab = backend.vocab_size  # tokens outside it are set aside, not trained
        while state.step < loop.max_steps:
            if loop.max_train_s and time.monotonic() - started > loop.max_train_s:
                break
            batch, waiting = self._next_batch(reader, data, summary, self._version(state))
            summary.waiting = waiting
            if not batch:
                break
            results, aside, row = self._assemble(batch, data, summary, vocab, self._version(state))
            batch = [key for key in batch if key not in aside]
            if not results:  # nothing trainable drawn (set aside, or no samples): draw again
                pending += batch
                continue
            row.update(self._train(results, backend, pad, state))
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
        if summary.ahead:
            self._say(
                f"agl: {summary.ahead} rollouts skipped: their calls say a policy version newer than the weights"
                f" trained ({self._version(state)}); if model.path is a later version, set offline.policy_version"
            )
        return summary

    def _version(self, state: LoopState) -> int:
        """The policy version of the weights being trained: model.path's version in the store, plus our steps."""
        return self.config.offline.policy_version + state.policy_version

    def _next_batch(
        self, reader: StoreCursor, data: Any, summary: OfflineSummary, current: int
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
            current=current,
            max_versions=reader.max_versions,
        )
        self._set_aside(selection.dropped, reader, data, summary)
        reader.forget(selection.ahead)  # not recorded: a later run, further on, may train them
        summary.ahead += len(selection.ahead)
        batch: list[RolloutKey] = []
        for group in selection.groups:
            if len(batch) + len(group) > config.loop.batch_rollouts and batch:
                break
            batch += group
        reader.forget(batch)
        return batch, selection.waiting

    def _set_aside(
        self, dropped: dict[str, list[RolloutKey]], reader: StoreCursor | None, data: Any, summary: OfflineSummary
    ) -> None:
        for reason, keys in dropped.items():
            data.mark_dropped(keys, reason)  # recorded: the next run does not look at them again
            if reader is not None:
                reader.forget(keys)
            summary.dropped[reason] = summary.dropped.get(reason, 0) + len(keys)

    def _assemble(
        self, keys: list[RolloutKey], data: Any, summary: OfflineSummary, vocab: int | None, current: int
    ) -> tuple[list[Any], set[RolloutKey], dict[str, float]]:
        """The step's rollouts as samples, less those the model cannot take (set aside, recorded)."""
        assembled = data.assemble(keys)
        results, bad = split([r for r in assembled.results if r.samples], vocab, current)
        ahead = bad.pop(VERSION_AHEAD, [])  # a token after a keep switch says a newer version: skipped, as select does
        summary.ahead += len(ahead)
        self._set_aside(bad, None, data, summary)
        if bad:
            self._say("agl: set aside (recorded): " + ", ".join(f"{len(v)} {k}" for k, v in sorted(bad.items())))
        row: dict[str, float] = {f"assembly/{k}": v for k, v in assembled.report.items()}
        row["rollouts/set_aside"] = float(sum(len(v) for v in bad.values()))
        return results, {key for keys in [*bad.values(), ahead] for key in keys}, row

    def _train(self, results: list[Any], backend: Any, pad: int, state: LoopState) -> dict[str, float]:
        from agl_trainer.batch import TrainingBatch
        from agl_trainer.loop.report import batch_metrics, number, reward_metrics

        started = time.monotonic()
        row: dict[str, float] = {"rollouts/trained": float(len(results))}
        batch = TrainingBatch.from_rollouts(results, pad)
        # The weights being trained: a token sampled by an older version is stale and importance-corrected.
        version = self._version(state)
        row.update({k: float(v) for k, v in backend.train_step(batch, version).items() if number(v)})
        row.update(batch_metrics(batch, version))
        row.update(reward_metrics([r.reward for r in results]))
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


def train_from_store(config: Config, store_path: str | Path, *, resume: bool = False, quiet: bool = False) -> OfflineSummary:
    return OfflineTrainer(config, store_path, resume=resume, quiet=quiet).run()
