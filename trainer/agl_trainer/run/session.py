"""One `agl train` run: start every part, run the loop, stop everything. The loop is the same for
both rollout sources; what starts around it differs.

Live (`agl train CONFIG`), every part on loopback:

    receiver + store  <- OTLP from the sidecar and the harnesses
    engine            <- serves the model; takes new weights in place
    sidecar           <- a subprocess in front of the engine; paused while training
    runner            <- starts the harness per rollout, pointed at the sidecar
    backend           <- trains on assembled batches

Stored (`agl train CONFIG --from-store traces.db`): the backend and the store, read (loop/stored.py).

Parts start in that order and stop in reverse, also on Ctrl-C (first: finish cleanly; second:
cancel now) and on errors. With `resume=True` the run continues from the newest checkpoint in
OUTPUT_DIR and the store: rollouts the checkpointed weights were trained on are never trained
again, and (live) every rollout launched but not trained is trained or relaunched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl import semconv

from agl_trainer.config import Config, ConfigError, dump_config, read_tasks
from agl_trainer.loop.checkpoint import RUN_FILE, Checkpoints, LoopState, open_run_dir
from agl_trainer.loop.core import LoopSummary, TrainingLoop
from agl_trainer.loop.groups import FLAT_GROUP, Group, GroupJournal, Member, TaskSchedule
from agl_trainer.loop.inflight import InFlight
from agl_trainer.loop.live import LiveRollouts
from agl_trainer.loop.progress import LoopProgress
from agl_trainer.loop.stored import StoredRollouts
from agl_trainer.models.hf_progress import quiet_progress
from agl_trainer.run.build import build_backend, build_validator, pad_token_id
from agl_trainer.runners.base import Cause, RolloutOutcome, RolloutSpec
from agl_trainer.store import RolloutKey


@dataclass
class RunResult:
    summary: LoopSummary
    output_dir: Path
    plot: Path | None = None
    checkpoint: Path | None = None  # the newest checkpoint in output_dir after the run
    stored: StoredRollouts | None = None  # --from-store: what was dropped, skipped, left waiting


@dataclass
class _Parts:
    """What `_start` builds for the loop beside the backend, by rollout source."""

    source: LiveRollouts | StoredRollouts
    data: Any  # StoreDataPlane
    validator: Any = None
    agreement_log: Any = None


class Session:
    def __init__(
        self, config: Config, *, resume: bool = False, quiet: bool = False, from_store: str | Path | None = None
    ) -> None:
        self.config = config
        self.resume = resume
        self.quiet = quiet
        self.from_store = Path(from_store) if from_store is not None else None
        self.output_dir = Path(config.output_dir)
        self._stack = contextlib.AsyncExitStack()
        self.loop: TrainingLoop | None = None
        self.on_step: Callable[[int, dict[str, float]], None] | None = None

    # --- run ---------------------------------------------------------------------------------
    async def run(self) -> RunResult:
        async with self._stack:
            # the run reports its own progress: transformers' bars ("Loading weights" at each load of
            # the backend, the reference model and the engine) are off for its duration
            self._stack.enter_context(quiet_progress())
            loop = await self._start()
            self._install_signals()
            summary = await loop.run()
        result = RunResult(summary, self.output_dir, checkpoint=loop.checkpoints.latest())
        if isinstance(loop.source, StoredRollouts):
            result.stored = loop.source
        else:
            from agl_trainer.metrics import plot_run

            result.plot = plot_run(self.output_dir, title=f"agl {self.config.loop.mode}")
        return result

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        presses = {"n": 0}

        def on_signal() -> None:
            presses["n"] += 1
            if presses["n"] == 1 and self.loop is not None:
                print("\nagl: stopping after the current step (Ctrl-C again to stop now)", file=sys.stderr)
                self.loop.request_stop()
            elif main is not None:
                main.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, on_signal)
                self._stack.callback(loop.remove_signal_handler, sig)

    # --- start-up ------------------------------------------------------------------------------
    async def _start(self) -> TrainingLoop:
        config, out = self.config, self.output_dir
        if self.from_store is not None and not self.from_store.is_file():
            raise ConfigError(
                f"--from-store {self.from_store}: no such rollout store (fix: the file `agl receive --store` wrote)"
            )
        if self.from_store is not None and config.loop.revisit_mixed:
            raise ConfigError(
                "config key loop.revisit_mixed: draws tasks again for new rollouts, which --from-store never "
                "launches (fix: leave it 0 for a run from a store)"
            )
        checkpoints, latest = open_run_dir(out, self.resume)
        run_id = self._run_id(out)
        # Addresses, secrets and tasks first: a wrong one fails before anything heavy starts.
        topology = self._topology() if self.from_store is None else None
        (out / "config.yaml").write_text(dump_config(config))
        tasks = read_tasks(config.tasks) if self.from_store is None else []  # type: ignore[arg-type]
        from agl_trainer.metrics.trackers import start_trackers

        trackers = start_trackers(config, out, kind="train")  # one that cannot start fails before the engine
        self._stack.callback(trackers.close)
        backend, state = await self._backend(run_id, checkpoints, latest)
        progress = LoopProgress(
            config.loop.max_steps, config.loop.batch_rollouts, enabled=not self.quiet, start_step=state.step
        )
        self._stack.callback(progress.close)
        if self.from_store is None:
            parts = await self._live(run_id, tasks, backend, state, latest is not None, topology, progress)
        else:
            parts = self._stored(self.from_store, backend, progress)
        if latest is not None:
            mark_checkpointed(checkpoints, state, parts.data)
        from agl_trainer.metrics import MetricsWriter

        metrics = MetricsWriter(out, trackers=trackers)
        self._stack.callback(metrics.close)
        self.loop = TrainingLoop(
            config.loop,
            source=parts.source,
            data=parts.data,
            backend=backend,
            checkpoints=checkpoints,
            state=state,
            metrics=metrics,
            progress=progress,
            pad_token_id=pad_token_id(str(config.model.path)),
            on_step=self.on_step,
            validator=parts.validator,
            agreement_log=parts.agreement_log,
        )
        run = {"run_id": run_id} | ({"from_store": str(self.from_store)} if self.from_store else {})
        (out / RUN_FILE).write_text(json.dumps(run))  # from now on, --resume continues it
        return self.loop

    def _topology(self) -> Any:
        """Where the sidecar and receiver listen and the auth secrets (run/topology.py), saved."""
        from agl_trainer.run import topology as addresses

        out = self.output_dir
        topology = addresses.resolve(self.config, saved=addresses.load_saved(out) if self.resume else None)
        addresses.save_secrets(out, topology)
        return topology

    async def _backend(self, run_id: str, checkpoints: Checkpoints, latest: Path | None) -> tuple[Any, LoopState]:
        """The backend (seeded) and the loop's state, both from the latest checkpoint on a resume."""
        config = self.config
        random.seed(config.seed)
        import torch

        torch.manual_seed(config.seed)
        backend = await asyncio.to_thread(build_backend, config, str(config.model.path))
        self._stack.callback(backend.close)  # the verl backend stops its workers (and Ray)
        if latest is None:
            # A stored run's weights start at the version the store gives model.path's (offline.policy_version).
            first = config.offline.policy_version if self.from_store else 0
            return backend, LoopState(run_id=run_id, policy_version=first)
        await asyncio.to_thread(backend.load_checkpoint, latest / "backend")
        return backend, checkpoints.load(latest)

    async def _live(
        self,
        run_id: str,
        tasks: list[dict[str, Any]],
        backend: Any,
        state: LoopState,
        resumed: bool,
        topology: Any,
        progress: LoopProgress,
    ) -> _Parts:
        """Receiver, store, engine (serving the checkpoint's policy on a resume), sidecars and runner
        (run/serving.py); the groups a resumed run recovers from its journal."""
        config, out = self.config, self.output_dir
        model_path = str(config.model.path)
        from agl_trainer.run.serving import start_serving

        async def load_checkpointed(engine: Any) -> None:
            if resumed:  # the engine serves the checkpoint's policy (a LoRA run: its adapter)
                from agl_trainer.engines.base import policy_update

                update = await asyncio.to_thread(policy_update, backend, engine, state.policy_version)
                await asyncio.to_thread(engine.update_weights, update)

        serving = await start_serving(
            config, out, self._stack, model_path, topology=topology, after_engine=load_checkpointed,
            harness_env={semconv.ENV_RUN_ID: run_id},
        )
        journal_path = out / "groups.jsonl"
        schedule = TaskSchedule(
            tasks, config.loop.group_size, config.seed, run_id, revisits=config.loop.revisit_mixed
        )
        recovered = recover_groups(journal_path, schedule, tasks, serving.data, state) if self.resume else []
        journal = GroupJournal(journal_path)
        self._stack.callback(journal.close)
        inflight = InFlight(
            config.loop, schedule=schedule, runner=serving.runner, journal=journal, data=serving.data,
            progress=progress,
        )  # fmt: skip
        source = LiveRollouts(
            inflight,
            engine=serving.engine,
            sidecar=serving.admin,
            policy=backend,
            canary=self._canary(config, serving.engine, backend, model_path),
        )
        for group in recovered:
            source.adopt(group, state.policy_version, state.step)
        validator = build_validator(config, serving.runner, serving.data, run_id, out, sidecar=serving.admin)
        return _Parts(source, serving.data, validator, self._agreement_log(out))

    def _stored(self, store_path: Path, backend: Any, progress: LoopProgress) -> _Parts:
        """The store, read (loop/stored.py); nothing is served."""
        from agl_trainer.run.dataplane import StoreDataPlane
        from agl_trainer.store import RolloutStore

        # Late spans are what offline.quiet_s waits for: a rollout that ended is ready at once.
        store = RolloutStore(store_path, grace_s=0.0)
        self._stack.callback(store.close)
        data = StoreDataPlane(store, self.config.assembly)
        source = StoredRollouts(
            store, store_path, data, loop=self.config.loop, offline=self.config.offline,
            vocab_size=backend.vocab_size, progress=progress,
        )  # fmt: skip
        return _Parts(source, data)

    def _agreement_log(self, out: Path) -> Any:
        """Per token, the trainer's logprobs of what it trained, for the viewer (store/agreement_log.py)."""
        from agl_trainer.store.agreement_log import AgreementLog

        log = AgreementLog(out)
        self._stack.callback(log.close)
        return log

    def _canary(self, config: Config, engine: Any, backend: Any, model_path: str) -> Any:
        """The canary on the engine's servers, one in turn (diagnostics.canary), closed with the session."""
        settings = config.diagnostics.canary
        if not settings.enabled or engine is None or not engine.urls:  # no engine of ours: nothing to probe
            return None
        from transformers import AutoTokenizer

        from agl_trainer.engines.probes import HttpProbeEngine
        from agl_trainer.loop.canary import Canary, CanarySettings

        probes = [HttpProbeEngine(url) for url in engine.urls]
        for probe in probes:
            self._stack.callback(probe.close)
        return Canary(
            CanarySettings(
                action=settings.action,
                tolerance=settings.tolerance,
                probes=settings.probes,
                tokens=settings.tokens,
                generate=settings.generate,
                seed=config.seed,
            ),
            engines=probes,
            vocab_size=len(AutoTokenizer.from_pretrained(model_path)),
            backend=backend,
            names=list(engine.urls),
        )

    def _run_id(self, out: Path) -> str:
        path = out / RUN_FILE
        if path.exists():
            return str(json.loads(path.read_text())["run_id"])
        return secrets.token_hex(3)  # written once every part has started (see _start)


def mark_checkpointed(checkpoints: Checkpoints, state: LoopState, data: Any) -> None:
    """A resumed run's checkpoint lists the rollouts its weights were trained on since the one
    before: a crash between the checkpoint and their marks left them unmarked; mark them now (and
    write their ledger line where the crash came before it)."""
    if not state.trained_since_previous:
        return
    keys = [RolloutKey(r, a) for r, a in state.trained_since_previous]
    data.mark_trained(keys, state.step)
    if state.step not in {step for step, _, _ in checkpoints.trained_ledger()}:
        checkpoints.record_trained(state.step, keys)


def recover_groups(
    journal_path: Path, schedule: TaskSchedule, tasks: list[dict[str, Any]], data: Any, state: LoopState
) -> list[Group]:
    """Groups the previous run launched and did not train (per the checkpoint): their complete
    rollouts are kept, the rest are relaunched (as new rollout ids) by the loop."""
    by_id = {str(task["id"]): task for task in tasks}
    trained = {RolloutKey(r, a) for r, a in state.trained_since_previous}
    entries = {e["index"]: e for e in GroupJournal.read(journal_path)}  # a relaunch rewrites its group
    schedule.resume(list(entries.values()), state.next_group_index)
    store = data.store
    recovered: list[Group] = []
    for entry in sorted(entries.values(), key=lambda e: e["index"]):
        task = by_id.get(entry["task_id"])
        if task is None or entry.get("mode", "train") != "train":
            continue
        index, version, ids = entry["index"], int(entry["version"]), list(entry["rollout_ids"])
        group = Group(index, task, version, ids, revisit=bool(entry.get("revisit")))
        infos = {rid: [i for i in store.find(rid) if i.rollout_id == rid] for rid in group.rollout_ids}
        if any(i.trained_step is not None or i.key in trained for found in infos.values() for i in found):
            continue  # trained (groups train whole): history
        if any(i.dropped_reason == FLAT_GROUP for found in infos.values() for i in found):
            continue  # set aside whole as flat (loop.skip_flat_groups): it would train nothing
        for rid, found in infos.items():
            done = [i for i in found if i.complete and i.dropped_reason is None]
            if done:
                latest = max(done, key=lambda i: i.attempt)
                group.states[rid] = Member.COMPLETE
                spec = RolloutSpec(rid, group.task_id, task, latest.attempt)
                group.outcomes[rid] = RolloutOutcome(spec, Cause.OK)
            else:
                group.states[rid] = Member.RUNNING  # died with the previous run: the loop relaunches it
        recovered.append(group)
    return recovered
