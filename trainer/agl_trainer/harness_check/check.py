"""One check: the parts started as `agl train` starts them, the harness run once, the report built.

    scripted engine <- sidecar (run/sidecar_client.SidecarProcess) <- tap <- the harness
                        | OTLP
                        v
                     receiver -> store (rollouts.db, in the check's folder)

The harness gets the environment a runner gives a rollout (runners/base.Endpoint: OPENAI_BASE_URL and
ANTHROPIC_BASE_URL with the rollout's prefix, the rollout and task ids, the task, the receiver for its
own spans), pointed at the tap, plus `env`. When it has exited, a drained pause (as before a training
step) waits until every call's span is acknowledged; then the sidecar and the receiver stop and the
store is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agl_trainer.harness_check.engine import ScriptedEngine
from agl_trainer.harness_check.report import HarnessRun, Report, build
from agl_trainer.harness_check.script import Script
from agl_trainer.harness_check.tap import Tap
from agl_trainer.loop.ports import SidecarError
from agl_trainer.run.sidecar_client import SidecarAdmin, SidecarProcess
from agl_trainer.runners.base import Endpoint, RolloutSpec
from agl_trainer.runners.local import run_process

TASK_ID = "harness-check"
LOG_TAIL_CHARS = 4000


@dataclass
class CheckOptions:
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the runner's variables (wins over them)
    cwd: str | None = None
    timeout_s: float = 300.0
    script: Script | None = None
    task: dict[str, Any] = field(default_factory=dict)  # AGL_TASK
    name: str | None = None  # the harness's name in the compatibility table (default: the program's)
    version: str | None = None  # and its version
    keep: Path | None = None  # keep the store and logs here (default: a temporary folder, removed)
    drain_timeout_s: float = 30.0


def run_check(options: CheckOptions, say: Callable[[str], None] = lambda line: None) -> Report:
    """Run the check; `say` hears what is happening. Raises runners.base.HarnessNotFound when the
    command cannot run, SidecarError when the sidecar does not start."""
    rollout_id = f"harness-check-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as stack:
        if options.keep is not None:
            folder = options.keep
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agl-harness-check-")))
        store_path = folder / "rollouts.db"
        from agl_trainer.receiver import Receiver, ReceiverConfig
        from agl_trainer.store import RolloutStore

        engine = ScriptedEngine(options.script).start()
        stack.callback(engine.stop)
        receiver = Receiver(store_path, ReceiverConfig(port=0)).start()
        stopped_receiver = stack.enter_context(_once(receiver.stop))
        say("starting the sidecar")
        sidecar = SidecarProcess(
            [engine.url], str(receiver.url), log_path=folder / "sidecar.log",
            extra_args=["--spool-dir", str(folder / "spool")],
        )  # fmt: skip
        sidecar.start()
        stack.callback(sidecar.stop)
        tap = Tap(sidecar.url).start()
        stack.callback(tap.stop)

        spec = RolloutSpec(rollout_id=rollout_id, task_id=TASK_ID, task=options.task)
        endpoint = Endpoint(sidecar_url=tap.url, otlp_endpoint=receiver.url, extra_env=dict(options.env))
        say(f"running the harness (rollout {rollout_id}, timeout {options.timeout_s:g} s)")
        started = time.monotonic()
        outcome = asyncio.run(run_process(
            options.command, env={**os.environ, **endpoint.environment(spec)}, cwd=options.cwd,
            timeout_s=options.timeout_s, log_path=folder / "harness.log", spec=spec,
        ))  # fmt: skip
        outcome.seconds = time.monotonic() - started
        say(f"the harness {outcome.message or 'exited with code 0'}; collecting its calls")
        undelivered, drain_problem = asyncio.run(_drain(sidecar, options.drain_timeout_s))
        sidecar.stop()
        stopped_receiver()
        violations = dict(receiver.stats().violations)
        with RolloutStore(store_path) as store:
            loaded = store.load_with_rows(rollout_id)
        data, rows = loaded if loaded is not None else (None, None)
        harness = HarnessRun(
            command=list(options.command), exit_code=outcome.exit_code, outcome=outcome.cause.value,
            message=outcome.message, seconds=round(outcome.seconds, 3), log_tail=_tail(folder / "harness.log"),
        )  # fmt: skip
        report = build(
            options.name or Path(options.command[0]).name, options.version, rollout_id, harness, tap.settled(), data,
            [] if rows is None else [int(start) for start in rows.column("start_ns")], violations, undelivered,
            drain_problem,
        )  # fmt: skip
    return report


async def _drain(sidecar: SidecarProcess, timeout_s: float) -> tuple[int, str | None]:
    """Hold new calls and wait for the calls in flight and their spans, as before a training step:
    (spans not acknowledged by the receiver in time, what went wrong when the sidecar did not answer)."""
    try:
        async with SidecarAdmin(sidecar.url, sidecar.admin_token, timeout_s=timeout_s + 10) as admin:
            state = await admin.pause(drain=True, timeout_s=timeout_s)
    except (SidecarError, httpx.HTTPError) as error:
        return 0, f"the sidecar did not drain its calls: {error}"
    return (0 if state.spans_flushed else state.spans_undelivered), None


@contextlib.contextmanager
def _once(stop: Callable[[], None]):  # type: ignore[no-untyped-def]
    """`stop` as a function to call early, run at exit only if it was not."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            stop()

    try:
        yield call
    finally:
        call()


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-LOG_TAIL_CHARS:].decode("utf-8", "replace")
