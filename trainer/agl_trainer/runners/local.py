"""Run a harness command once per rollout as a local process.

Each rollout gets its own process group (so a timeout kills the harness and everything it started),
its own log file, and the rollout's endpoint and ids in its environment (see runners.base.Endpoint).
Harness failures (non-zero exit) are reported, not retried; infrastructure failures (could not
start, killed from outside, exit code 75) are retried as new attempts. An optional grader command
runs after a successful harness with the same environment and prints the reward on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from agl import semconv

from agl_trainer.runners.base import (
    EXIT_INFRA_RETRY,
    Cause,
    Endpoint,
    ExitHook,
    HarnessNotFound,
    RewardSink,
    RolloutOutcome,
    RolloutSpec,
    call_hook,
    run_with_retries,
)

KILL_GRACE_S = 2.0  # SIGTERM first so the harness can flush its spans, then SIGKILL


class CommandRunner:
    def __init__(
        self,
        argv: list[str],
        endpoint: Endpoint,
        *,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        retries: int = 2,
        log_dir: Path | None = None,
        cwd: str | None = None,
        grader: list[str] | None = None,
        on_exit: ExitHook | None = None,
        reward_sink: RewardSink | None = None,
    ) -> None:
        self.argv = argv
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retries = retries
        self.log_dir = log_dir
        self.cwd = cwd
        self.grader = grader
        self.on_exit = on_exit
        self.reward_sink = reward_sink
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    async def stop(self) -> None:
        pass  # every process belongs to a run() call, whose cancellation kills it

    async def run(self, spec: RolloutSpec) -> RolloutOutcome:
        async with self._slots:
            return await run_with_retries(self._attempt, spec, self.retries)

    async def _attempt(self, spec: RolloutSpec) -> RolloutOutcome:
        started = time.monotonic()
        outcome = await run_process(
            self.argv,
            env=self._env(spec),
            cwd=self.cwd,
            timeout_s=self.timeout_s,
            log_path=self._log_path(spec),
            spec=spec,
        )
        if outcome.ok and self.grader is not None:
            await self._grade(spec, outcome)
        outcome.seconds = time.monotonic() - started
        await call_hook(self.on_exit, outcome)
        return outcome

    def _env(self, spec: RolloutSpec) -> dict[str, str]:
        return {**os.environ, **self.endpoint.environment(spec)}

    def _log_path(self, spec: RolloutSpec) -> Path | None:
        if self.log_dir is None:
            return None
        suffix = f".attempt{spec.attempt}" if spec.attempt else ""
        return self.log_dir / f"{spec.rollout_id}{suffix}.log"

    async def _grade(self, spec: RolloutSpec, outcome: RolloutOutcome) -> None:
        """Run the grader; its last stdout line is the reward. A bad grader fails the rollout."""
        assert self.grader is not None
        env = self._env(spec)
        if outcome.log_path:
            env[semconv.ENV_ROLLOUT_LOG] = outcome.log_path
        process = await asyncio.create_subprocess_exec(
            *self.grader,
            env=env,
            cwd=self.cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), self.timeout_s)
        except asyncio.TimeoutError:
            await _kill_group(process)
            outcome.cause, outcome.message = Cause.HARNESS_ERROR, "grader timed out"
            return
        except asyncio.CancelledError:
            await _kill_group(process)
            raise
        lines = stdout.decode(errors="replace").strip().splitlines()
        try:
            if process.returncode != 0 or not lines:
                raise ValueError
            reward = float(lines[-1])
        except ValueError:
            outcome.cause = Cause.HARNESS_ERROR
            outcome.message = (
                f"grader exited {process.returncode} without a number on its last stdout line: "
                f"{(lines[-1] if lines else stderr.decode(errors='replace')[-200:])!r}"
            )
            return
        outcome.reward = reward
        if self.reward_sink is not None:
            await self.reward_sink(spec, reward)


async def run_process(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str | None,
    timeout_s: float,
    log_path: Path | None,
    spec: RolloutSpec,
) -> RolloutOutcome:
    """Run one harness process to its end, in its own process group, and classify how it ended."""
    log = open(log_path, "wb") if log_path is not None else None
    out = log if log is not None else asyncio.subprocess.DEVNULL
    logged = str(log_path) if log_path is not None else None
    try:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=cwd, stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True
            )
        except (FileNotFoundError, PermissionError) as error:
            raise HarnessNotFound(f"cannot run harness {argv[0]!r}: {error.strerror} (fix: harness.command)") from None
        except OSError as error:  # EAGAIN, ENOMEM: the machine, not the harness
            return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"could not start: {error}", log_path=logged)
        try:
            code = await asyncio.wait_for(process.wait(), timeout_s)
        except asyncio.TimeoutError:
            await _kill_group(process)
            return RolloutOutcome(
                spec, Cause.TIMEOUT, process.returncode, message=f"killed after {timeout_s:g} s", log_path=logged
            )
        except asyncio.CancelledError:
            await _kill_group(process)
            raise
        finally:
            # Whatever the harness started in the background goes with it.
            _signal_group(process.pid, signal.SIGKILL)
    finally:
        if log is not None:
            log.close()
    if code == 0:
        return RolloutOutcome(spec, Cause.OK, 0, log_path=logged)
    if code == EXIT_INFRA_RETRY or code == -signal.SIGKILL:
        return RolloutOutcome(spec, Cause.INFRA_ERROR, code, message=_exit_text(code), log_path=logged)
    return RolloutOutcome(spec, Cause.HARNESS_ERROR, code, message=_exit_text(code), log_path=logged)


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _kill_group(process: asyncio.subprocess.Process) -> None:
    _signal_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(process.wait()), KILL_GRACE_S)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    _signal_group(process.pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(process.wait()), KILL_GRACE_S)
