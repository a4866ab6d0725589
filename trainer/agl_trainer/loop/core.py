"""The training loop: generate rollouts, train on complete groups, push weights, repeat.

    sync:              launch a batch -> wait for all of it -> train -> sync weights -> repeat
    collocated-async:  keep rollouts in flight; when complete groups fill a batch:
                       pause the sidecar (new calls held) -> drain in-flight calls -> train ->
                       sync weights -> resume with policy version + 1; unfinished rollouts carry on
    loop.switch=keep:  as collocated-async, but the engine freezes the calls in flight instead of
                       draining them; they continue under the new weights, and their spans say
                       where each version starts (agl.completion.policy_versions)

Staleness: a group launched under version v may be trained by a step running version c only if
c - v <= loop.staleness. Before an update, groups that would break the bound are waited for
(stale_policy=wait: the batch takes them) or dropped (stale_policy=drop: their harnesses are
killed). stale_policy=mask bounds each token instead: no step waits for a running group, which
runs on across updates (up to loop.max_span) and trains later; its tokens sampled by a version
older than c - loop.staleness get no loss. Calls a rollout made under older weights keep their
engine logprobs and versions; the algorithms correct them with truncated importance weights.

loop.generate_during_training (with switch=keep): the rollouts in flight go on, and new ones
launch, while the trainer trains; the pause is only the weight load's (freeze, load, thaw).

Per step the loop records time generating, draining, training, syncing, checkpointing, and idle
(no call in flight at the sidecar while generating), and the engine's idle fraction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agl_trainer.batch import RolloutResult, TrainingBatch
from agl_trainer.config import LoopConfig
from agl_trainer.engines.base import InferenceEngine, policy_update
from agl_trainer.store.agreement_log import AgreementLog
from agl_trainer.loop.canary import Canary, CanaryResult, CanaryStop
from agl_trainer.loop.checkpoint import Checkpoints, LoopState
from agl_trainer.loop.groups import Group, GroupJournal, Member, TaskSchedule
from agl_trainer.loop.inflight import InFlight
from agl_trainer.loop.ports import Backend, DataPlane, Resume, SidecarControl, SidecarError
from agl_trainer.loop.progress import LoopProgress
from agl_trainer.loop.report import StepTimes, batch_metrics, number, reward_metrics
from agl_trainer.loop.validation import Validator
from agl_trainer.runners.base import Runner
from agl_trainer.store.records import RolloutKey

log = logging.getLogger("agl.loop")

POLL_S = 0.05
IDLE_SAMPLE_S = 0.1
VAL_FAILURES_SHOWN = 3  # a validation round names this many of its failed rollouts, and counts the rest


class StopTraining(Exception):
    """Ends the loop early (a stop request, loop.max_train_s). `final_validation`: the final policy
    is still measured (out of time), not abandoned (asked to stop)."""

    def __init__(self, reason: str, *, final_validation: bool = False) -> None:
        super().__init__(reason)
        self.final_validation = final_validation


@dataclass
class LoopSummary:
    steps: int
    policy_version: int
    history: list[dict[str, float]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    validation: list[dict[str, float]] = field(default_factory=list)  # val/* per round, with "step"


@dataclass
class _StepNotes:
    """What one update learns on its way, for its metrics."""

    in_flight_at_pause: int
    undelivered: int = 0  # call spans the drain could not deliver
    assembly_s: float = 0.0
    assembly: dict[str, float] = field(default_factory=dict)  # assembly/... counts
    too_stale: int = 0  # rollouts left with no trainable token by the staleness bound
    masked_tokens: int = 0  # stale_policy=mask: tokens past the bound taken out of the loss
    metrics: dict[str, float] = field(default_factory=dict)
    frozen: dict[str, int] | None = None  # loop.switch=keep: engine request id -> tokens at the freeze


class TrainingLoop:
    def __init__(
        self,
        config: LoopConfig,
        *,
        schedule: TaskSchedule,
        runner: Runner,
        data: DataPlane,
        backend: Backend,
        engine: InferenceEngine,
        sidecar: SidecarControl,
        checkpoints: Checkpoints,
        journal: GroupJournal,
        state: LoopState,
        metrics: Any = None,
        progress: LoopProgress | None = None,
        pad_token_id: int = 0,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        validator: Validator | None = None,
        canary: Canary | None = None,
        agreement_log: AgreementLog | None = None,
    ) -> None:
        self.config = config
        self.canary = canary
        self.agreement_log = agreement_log
        self.validator = validator
        self.validation: list[dict[str, float]] = []
        self.schedule = schedule
        self.data = data
        self.backend = backend
        self.engine = engine
        self.sidecar = sidecar
        self.checkpoints = checkpoints
        self.state = state
        self.metrics = metrics
        self.progress = progress or LoopProgress(config.max_steps, config.batch_rollouts, enabled=False)
        self.pad_token_id = pad_token_id
        self.on_step = on_step
        self.inflight = InFlight(
            config, schedule=schedule, runner=runner, journal=journal, data=data, progress=self.progress,
            on_fatal=self._end,
        )  # fmt: skip
        self.trained_since_checkpoint: list[RolloutKey] = []
        self.history: list[dict[str, float]] = []
        self._times = StepTimes()
        self._dropped_stale = 0
        # The one way the loop ends early: the first reason set here is raised at the next check
        # (a stop request as StopTraining, a fatal error as itself); CanaryStop is raised in place.
        self._exit: BaseException | None = None
        self._started = time.monotonic()

    @property
    def version(self) -> int:
        return self.state.policy_version

    def request_stop(self) -> None:
        self._end(StopTraining("stop requested"))

    def adopt(self, group: Group) -> None:
        """A group launched before a restart (run/session.py recovers them from the journal)."""
        self.inflight.adopt(group, self.version, self.state.step)

    def _end(self, reason: BaseException) -> None:
        """The first reason wins, but a stop request or an error outranks running out of time (which
        would still measure the final policy)."""
        current = self._exit
        if current is None or (isinstance(current, StopTraining) and current.final_validation):
            self._exit = reason

    # --- the loop ----------------------------------------------------------------------------
    async def run(self) -> LoopSummary:
        self._started = time.monotonic()  # loop.max_train_s counts training, not start-up
        sampler = asyncio.create_task(self._sample_idle())
        try:
            await self.sidecar.resume(Resume(policy_version=self.version))
            self._act_on(await self._check_canary())  # the engine agrees with the trainer from the start
            await self._validate_if_due()
            while self.state.step < self.config.max_steps:
                self._times = StepTimes()
                generating_since = time.monotonic()
                if self.config.mode == "sync":
                    batch = await self._generate_sync()
                else:
                    batch = await self._generate_async()
                self._times.generating = time.monotonic() - generating_since
                await self._update(batch)
                await self._validate_if_due()
            await self._validate_final()
        except StopTraining as stop:
            self.progress.log(f"agl: stopping: {stop}")
            if stop.final_validation:
                try:
                    await self._validate_final()
                except StopTraining as again:  # asked to stop during the final round: it is abandoned
                    self.progress.log(f"agl: stopping: {again}")
        finally:
            sampler.cancel()
            await self.inflight.cancel_all()
            if self.trained_since_checkpoint:
                self._checkpoint()
        summary = LoopSummary(self.state.step, self.version, self.history, dict(self.inflight.failures))
        summary.validation = self.validation
        return summary

    def _check_stop(self, *, clock: bool = True) -> None:
        if self._exit is not None:
            raise self._exit
        limit = self.config.max_train_s
        if clock and limit and time.monotonic() - self._started > limit:
            self._exit = StopTraining(f"loop.max_train_s={limit:g} reached", final_validation=True)
            raise self._exit

    # --- validation (loop/validation.py) ------------------------------------------------------
    async def _validate_if_due(self) -> None:
        if self.validator is not None and self.validator.plan.due(self.state.step):
            await self._validate()

    async def _validate_final(self) -> None:
        if self.validator is None or self.validator.plan.every <= 0 or self.validator.last_step == self.state.step:
            return
        if isinstance(self._exit, StopTraining) and self._exit.final_validation:
            self._exit = None  # out of training time: the final round still runs (a new stop ends it)
        await self.inflight.cancel_all()  # training is over: its rollouts in flight would only compete
        await self._validate()

    async def _validate(self) -> None:
        """A round of held-out rollouts in mode val; never trained. Its time is not training time."""
        assert self.validator is not None
        started = time.monotonic()
        # only a stop request or a fatal error abandons a round; its time is not training time
        metrics = await self.validator.run(self.state.step, self.version, lambda: self._check_stop(clock=False))
        self._started += time.monotonic() - started  # loop.max_train_s counts training only
        self.validation.append({"step": float(self.state.step), **metrics})
        if self.metrics is not None:
            self.metrics.write(self.state.step, metrics)
        reward, sampled = metrics.get("val/reward"), metrics.get("val/sampled/reward")
        self.progress.log(
            f"agl: validation at step {self.state.step}: "
            + (f"reward {reward:.3f}, pass rate {metrics['val/pass_rate']:.3f}" if reward is not None else "no data")
            + f" over {metrics['val/count']:.0f} rollouts ({metrics['val/failed']:.0f} failed)"
            + (
                f"; sampled mean@{metrics['val/sampled/k']:.0f} {sampled:.3f}"
                f" over {metrics['val/sampled/count']:.0f} rollouts"
                if sampled is not None
                else ""
            )
        )
        for line in self.validator.last_failures[:VAL_FAILURES_SHOWN]:
            self.progress.log(f"agl: validation rollout {line}")
        if len(self.validator.last_failures) > VAL_FAILURES_SHOWN:
            self.progress.log(f"agl: ... and {len(self.validator.last_failures) - VAL_FAILURES_SHOWN} more")

    # --- generating (the rollouts in flight: loop/inflight.py) ----------------------------------
    async def _generate_sync(self) -> list[Group]:
        """Launch one batch, wait for all of it."""
        groups = [self.inflight.launch(self.version) for _ in range(self.config.batch_rollouts // self.config.group_size)]
        while not all(group.done for group in groups):
            self._check_stop()
            self.inflight.poll_completion()
            await asyncio.sleep(POLL_S)
        return groups

    async def _generate_async(self) -> list[Group]:
        """Keep rollouts in flight until complete groups fill a batch (and staleness allows)."""
        while True:
            self._check_stop()
            self.inflight.poll_completion()
            batch = self.inflight.ready_batch(self.version)
            if batch is not None:
                return batch
            self.inflight.launch_what_fits(self.version)
            await asyncio.sleep(POLL_S)

    async def _sample_idle(self) -> None:
        """Accumulate time with no call in flight at the sidecar (engine idle) while generating."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(IDLE_SAMPLE_S)
            now = time.monotonic()
            try:
                state = await self.sidecar.state()
            except (SidecarError, OSError, Exception):  # a missed sample is not worth failing for
                last = now
                continue
            if not state.paused and state.in_flight == 0 and state.held == 0:
                self._times.idle += now - last
            last = now

    # --- updating ------------------------------------------------------------------------------
    async def _update(self, batch: list[Group]) -> None:
        """One training step on `batch`, top to bottom."""
        overlap = self.config.generate_during_training
        step = _StepNotes(in_flight_at_pause=len(self.inflight.tasks))
        if not overlap:
            await self._pause_and_drain(step)
        self._dropped_stale += await self.inflight.drop_overdue(self.version, exclude=batch)
        keys = self.inflight.trainable_keys(batch)
        started = time.monotonic()
        results = await self._assemble(batch, keys, step)
        training_since = time.monotonic()
        generating = asyncio.create_task(self._keep_generating()) if overlap else None
        try:
            await self._train(results, step)
        finally:
            if generating is not None:
                generating.cancel()
                await asyncio.gather(generating, return_exceptions=True)
        self._times.training = time.monotonic() - started
        self._times.overlapped = time.monotonic() - training_since if overlap else 0.0
        if overlap:  # the pause is the weight load's alone
            step.in_flight_at_pause = len(self.inflight.tasks)
            await self._pause_and_drain(step)
        new_version = await self._sync_weights(step)
        self._advance(batch, keys, results, new_version)
        keep = self.config.switch == "keep"
        # the canary right after the new weights: on an idle engine before the resume; after a keep
        # pause the frozen engine generates nothing until the resume (its probes then share the engine)
        canary = None if keep else await self._check_canary()
        await self._resume(new_version, step)
        if keep:
            canary = await self._check_canary()
        if canary is not None:
            step.metrics.update(canary.metrics())
        self._report(batch, results, step)
        self._act_on(canary)

    async def _keep_generating(self) -> None:
        """loop.generate_during_training: while the trainer trains, rollouts end and new ones launch
        (under the current version; they train at a later step, importance-corrected)."""
        while True:
            self.inflight.poll_completion()
            self.inflight.launch_what_fits(self.version)
            await asyncio.sleep(POLL_S)

    async def _check_canary(self) -> CanaryResult | None:
        """The probes scored by the engine and the trainer, both at the current version (loop/canary.py)."""
        if self.canary is None:
            return None
        result = await asyncio.to_thread(self.canary.check, self.version)
        self._times.canary = result.seconds
        return result

    def _act_on(self, result: CanaryResult | None) -> None:
        if result is None or result.verdict == "agree":
            return
        where = f"agl canary at policy version {result.version} [{result.verdict}]: {result.message}"
        if result.verdict != "error" and self.canary is not None and self.canary.settings.action == "stop":
            raise CanaryStop(where + " (diagnostics.canary.action: stop)")
        self.progress.log(where)

    async def _pause_and_drain(self, step: _StepNotes) -> None:
        """Pause the sidecar (new calls held) and wait for in-flight calls and their spans; with
        loop.switch=keep, wait for no call: the engine freezes them where they are (_resume thaws)."""
        started = time.monotonic()
        keep = self.config.switch == "keep"
        try:
            # The sidecar waits (up to the drain timeout) until the receiver acknowledged the drained
            # calls' spans; what it could not deliver by then is missing from this batch: say so.
            if keep:  # the finished calls' spans are delivered; the frozen calls end after the update
                paused = await self.sidecar.pause(keep=True, timeout_s=self.config.drain_timeout_s)
                step.frozen = await asyncio.to_thread(self.engine.freeze)
            else:
                paused = await self.sidecar.pause(drain=True, timeout_s=self.config.drain_timeout_s)
            if not paused.spans_flushed:
                step.undelivered = max(paused.spans_undelivered, 1)
                self.inflight.count("spans_undelivered_at_update")
                self.progress.log(
                    f"agl: {paused.spans_undelivered} call span(s) had not reached the receiver "
                    f"{self.config.drain_timeout_s:g} s into the drain ({paused.spans_in_spool} in the sidecar's "
                    "spool: is the receiver reachable?); this batch is assembled without them"
                )
        except SidecarError as error:
            self.progress.log(f"agl: drain did not finish ({error}); updating anyway")
        self._times.draining = time.monotonic() - started

    async def _resume(self, new_version: int, step: _StepNotes) -> None:
        """Release the held calls under `new_version`. After a keep pause the sidecar first records
        the switch (where the new version starts in each frozen call: the engine's token counts),
        then the engine continues the frozen calls: no token of the new weights precedes the record."""
        if self.config.switch != "keep":
            await self.sidecar.resume(Resume(policy_version=new_version))
            return
        try:
            await self.sidecar.resume(
                Resume(policy_version=new_version, switch=True, engine_progress=step.frozen)
            )
        finally:
            await asyncio.to_thread(self.engine.thaw)

    async def _assemble(self, batch: list[Group], keys: list[RolloutKey], step: _StepNotes) -> list[RolloutResult]:
        """The batch's rollouts as training samples, with the failed-rollout and staleness rules applied."""
        started = time.monotonic()
        assembled = await asyncio.to_thread(self.data.assemble, keys) if keys else None
        step.assembly_s = time.monotonic() - started
        if assembled is not None:
            step.assembly = {f"assembly/{k}": float(v) for k, v in assembled.report.items() if number(v)}
        results = self._apply_failed_policy(batch, assembled.results if assembled else [])
        results, too_stale, step.masked_tokens = self._filter_stale(results)
        if too_stale:
            step.too_stale = len(too_stale)
            self.data.mark_dropped([RolloutKey(r.rollout_id, r.attempt) for r in too_stale], "stale tokens")
        return results

    async def _train(self, results: list[RolloutResult], step: _StepNotes) -> None:
        # Collocated on a GPU: the engine frees its memory for training; update_weights wakes it.
        # Not after a keep pause: sleeping would drop the frozen calls' KV cache.
        if self.config.switch != "keep":
            await asyncio.to_thread(self.engine.sleep)
        if not (results and any(r.samples for r in results)):
            return
        training_batch = TrainingBatch.from_rollouts(results, self.pad_token_id)
        train_metrics = await asyncio.to_thread(self.backend.train_step, training_batch, self.version)
        if self.agreement_log is not None and self.backend.last_logprobs is not None:
            self.agreement_log.write(self.state.step + 1, self.version, results, self.backend.last_logprobs)
        step.metrics.update({k: float(v) for k, v in train_metrics.items() if number(v)})
        step.metrics.update(batch_metrics(training_batch, self.version))

    async def _sync_weights(self, step: _StepNotes) -> int:
        """Push the trained weights to the engine as the next policy version; returns it. A LoRA run
        sends the adapter alone where the engine takes one, else the merged weights."""
        started = time.monotonic()
        new_version = self.version + 1
        update = await asyncio.to_thread(policy_update, self.backend, self.engine, new_version)
        await asyncio.to_thread(self.engine.update_weights, update)
        self._times.syncing = time.monotonic() - started
        step.metrics["sync/bytes"] = float(update.nbytes)
        step.metrics["sync/adapter_only"] = float(update.adapter is not None)
        return new_version

    def _advance(
        self, batch: list[Group], keys: list[RolloutKey], results: list[RolloutResult], new_version: int
    ) -> None:
        """The loop's state after the step: version, step, what was trained; checkpoint when due."""
        self.state.policy_version = new_version
        self.state.step += 1
        key_of = {key.rollout_id: key for key in keys}
        self.trained_since_checkpoint += [key_of[r.rollout_id] for r in results]
        self.inflight.retire(batch)
        if self.state.step % self.config.checkpoint_every == 0:
            started = time.monotonic()
            self._checkpoint()
            self._times.checkpoint = time.monotonic() - started

    def _report(self, batch: list[Group], results: list[RolloutResult], step: _StepNotes) -> None:
        metrics = step.metrics  # the backend's and the batch's, then the loop's own
        metrics.update(self._times.metrics())
        metrics["time/assembly_s"] = step.assembly_s  # part of time/training_s
        metrics["spans/undelivered_at_update"] = float(step.undelivered)
        metrics.update(
            {
                "policy_version": float(self.version),
                "rollouts/trained": float(len(results)),
                "rollouts/failed": float(sum(len(g.ids_in(Member.FAILED)) for g in batch)),
                "rollouts/dropped_stale": float(self._dropped_stale + step.too_stale),
                "staleness/masked_tokens": float(step.masked_tokens),
                "rollouts/in_flight_at_pause": float(step.in_flight_at_pause),
            }
        )
        if step.frozen is not None:
            metrics["switch/frozen_requests"] = float(len(step.frozen))
        metrics.update(reward_metrics([r.reward for r in results]))
        metrics.update(step.assembly)
        self._dropped_stale = 0
        self.history.append(metrics)
        if self.metrics is not None:
            self.metrics.write(self.state.step, metrics)
        if self.on_step is not None:
            self.on_step(self.state.step, metrics)
        self.progress.step(self.state.step, metrics.get("reward/mean"), metrics["time/step_s"])

    def _apply_failed_policy(self, batch: list[Group], results: list[RolloutResult]) -> list[RolloutResult]:
        if self.config.failed_rollouts != "zero":
            return results
        failed = {rid for group in batch for rid in group.ids_in(Member.FAILED)}
        for result in results:
            if result.rollout_id in failed:
                result.reward = 0.0
        return results

    def _filter_stale(
        self, results: list[RolloutResult]
    ) -> tuple[list[RolloutResult], list[RolloutResult], int]:
        """The staleness bound on what trains: tokens sampled by a version older than allowed. With
        stale_policy=mask they leave the loss (a rollout left with none is dropped); otherwise (a
        safety net: the scheduling already keeps them out) their rollout is dropped. Returns the
        results kept, those dropped, the tokens masked."""
        oldest_allowed = self.version - self.config.staleness
        masking = self.config.stale_policy == "mask"
        kept: list[RolloutResult] = []
        dropped: list[RolloutResult] = []
        masked = 0
        for result in results:
            stale = [
                (sample, i)
                for sample in result.samples
                for i, (v, m) in enumerate(zip(sample.policy_versions, sample.loss_mask))
                if m and v < oldest_allowed
            ]
            if stale and not masking:
                dropped.append(result)
                continue
            for sample, i in stale:
                sample.loss_mask[i] = 0
            masked += len(stale)
            if not stale or any(sample.num_trained_tokens for sample in result.samples):
                kept.append(result)
            else:
                dropped.append(result)
        return kept, dropped, masked

    def _checkpoint(self) -> None:
        self.state.next_group_index = self.schedule.next_index
        self.state.trained_since_previous = [(k.rollout_id, k.attempt) for k in self.trained_since_checkpoint]
        self.checkpoints.save(self.state, self.backend)
        # Only now, with weights that include them on disk, do these count as trained.
        if self.trained_since_checkpoint:
            self.data.mark_trained(self.trained_since_checkpoint, self.state.step)
            self.checkpoints.record_trained(self.state.step, self.trained_since_checkpoint)
        self.trained_since_checkpoint = []
