"""Run a Python harness given as `module:function` inside long-lived runner worker processes.

Starting a Python harness per rollout costs its imports every time (`import openai` alone is about
0.7 s of CPU); a worker imports the function once and then calls it once per rollout, many at a
time on threads (harness calls block on HTTP, not on CPU). The function is called as
`function(task: dict, base_url: str)` (sync or async) inside `agl.rollout(...)` for that rollout,
so `agl.emit_reward()` inside it is attributed without arguments, and calls made to `base_url` go
through the sidecar exactly as a process harness's would. A number returned is emitted as the
rollout's reward. Exceptions are harness errors; a worker that dies fails its rollouts as
infrastructure errors (retried) and is replaced.

A function that hangs past the timeout is reported as timed out; its thread cannot be killed and
finishes in the background (its late calls are attributed to a rollout that is already closed).

Each worker answers on a pipe of its own. A multiprocessing.Queue shared by all workers would hold
a lock across processes while one writes: a worker killed mid-write (a harness calling os._exit)
leaves it taken, and every other worker blocks on its next result forever.

Requests go to each worker on a pipe of its own too, not a multiprocessing.Queue: a Queue's feeder
thread is joined at interpreter exit, and the parent keeps the Queue's read end open, so a worker
that died with more queued for it than a pipe holds left the feeder blocked on a write nobody would
read and the trainer hung at exit (whenever stop() had not discarded that queue first: a crash, an
interrupt, a worker dying between two watcher passes). Here the parent holds only the write end
(a dead worker makes writes fail with EPIPE, and the sender drops the rest) and the sender is a
daemon thread that nothing joins, so exit never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from agl import semconv
from agl_trainer.runners.base import (
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

READY_TIMEOUT_S = 120.0
WORKER_FLUSH_TIMEOUT_S = 10.0  # a worker delivers a rollout's spans before it reports the rollout ended
log = logging.getLogger("agl.runner")


@dataclass(frozen=True)
class _Request:
    request_id: int
    spec: RolloutSpec
    base_url: str


@dataclass(frozen=True)
class _Result:
    request_id: int
    cause: str
    reward: float | None
    message: str
    seconds: float


def load_function(reference: str) -> Any:
    """Import `module:function` (attributes may be dotted), with errors that say what is missing."""
    module_name, _, attr_path = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise HarnessNotFound(
            f"harness.function {reference!r}: cannot import module {error.name!r} (fix: check the name and "
            "that its directory is on PYTHONPATH or the current directory)"
        ) from None
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise HarnessNotFound(f"harness.function {reference!r}: {module_name} has no attribute {attr_path!r}")
        target = getattr(target, attr)
    if not callable(target):
        raise HarnessNotFound(f"harness.function {reference!r} is not callable")
    return target


def _worker_main(
    reference: str, env: dict[str, str], requests: Connection, results: Connection, threads: int
) -> None:
    """A runner worker: import once, then run each request on a thread inside agl.rollout()."""
    send_lock = threading.Lock()  # this process's threads take turns on the pipe

    def send(item: Any) -> None:
        with send_lock:
            results.send(item)

    os.environ.update(env)
    # `agl` runs as a console script, whose sys.path starts at the venv's bin/: make the current
    # directory importable, as `python -c` would, so `examples.demo.harness` resolves from the repo.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = load_function(reference)
        import agl
    except BaseException as error:  # report, never hang the parent
        send(("failed", f"{type(error).__name__}: {error}"))
        return
    send(("ready", os.getpid()))
    _exit_with_parent()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agl-harness")
    is_async = asyncio.iscoroutinefunction(function)

    def one(request: _Request) -> None:
        spec, started = request.spec, time.monotonic()
        cause, reward, message = Cause.OK.value, None, ""
        try:
            with agl.rollout(spec.rollout_id, spec.task_id, spec.attempt, spec.mode):
                value = (
                    asyncio.run(function(spec.task, request.base_url))
                    if is_async
                    else function(spec.task, request.base_url)
                )
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    reward = float(value)
                    agl.emit_reward(reward)
        except BaseException as error:  # the harness's own failure
            cause = Cause.HARNESS_ERROR.value
            message = "".join(traceback.format_exception_only(type(error), error)).strip()
        # The rollout's own spans (its end, its reward) leave now, before the trainer hears it ended:
        # a process harness flushes at exit; a worker lives on, and its batch would wait up to the
        # SDK's schedule delay, past loop.completion_grace_s on a busy machine (the rollout read
        # complete without its reward).
        agl.flush(WORKER_FLUSH_TIMEOUT_S)
        send(_Result(request.request_id, cause, reward, message, time.monotonic() - started))

    while True:
        try:
            request = requests.recv()
        except (EOFError, OSError):  # the trainer closed our pipe or died
            break
        if request is None:
            break
        pool.submit(one, request)
    pool.shutdown(wait=True)
    agl.flush()


def _exit_with_parent() -> None:
    """A worker whose trainer died (SIGKILL, crash) exits instead of waiting on its queue forever."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="agl-parent-watch", daemon=True).start()


class _RequestPipe:
    """Requests to one worker: put() never blocks; a daemon thread writes them to the worker's pipe.

    The parent holds only the pipe's write end, so once the worker is gone a write fails (EPIPE)
    and the thread drops what is left and ends; while the worker lives but reads nothing, the thread
    may wait on a full pipe, and since it is a daemon nothing waits for it at exit."""

    def __init__(self, connection: Connection, name: str) -> None:
        self._connection = connection
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._send_all, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        if not self._closed:
            self._items.put(item)

    def close(self) -> None:
        """Send nothing more; what is still queued is dropped."""
        self._closed = True
        self._items.put(_CLOSE)

    def _send_all(self) -> None:
        try:
            while True:
                item = self._items.get()
                if item is _CLOSE or self._closed:
                    return
                self._connection.send(item)
        except (OSError, ValueError):  # the worker is gone (EPIPE) or the pipe was closed
            self._closed = True
        finally:
            with contextlib.suppress(OSError):
                self._connection.close()


_CLOSE = object()


class _Worker:
    def __init__(self, context: Any, reference: str, env: dict[str, str], threads: int) -> None:
        requests_end, requests = context.Pipe(duplex=False)
        self.results, results_end = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_worker_main, args=(reference, env, requests_end, results_end, threads), daemon=True
        )
        self.pending: set[int] = set()
        self.abandoned = 0  # requests given up on (timed out, cancelled) that may still be running
        self.reader: threading.Thread | None = None
        self.process.start()
        results_end.close()  # the worker holds the only writing end: its exit is EOF here
        requests_end.close()  # ... and the only reading end: its exit is EPIPE for the sender
        self.requests = _RequestPipe(requests, name=f"agl-runner-requests-{self.process.pid}")

    def discard_queue(self) -> None:
        """Drop what is still queued for a dead or stopped worker."""
        self.requests.close()


class FunctionRunner:
    """Call `module:function` once per rollout in `workers` processes, `concurrency` at a time."""

    def __init__(
        self,
        reference: str,
        endpoint: Endpoint,
        *,
        workers: int = 2,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        retries: int = 2,
        env: dict[str, str] | None = None,
        on_exit: ExitHook | None = None,
        reward_sink: RewardSink | None = None,
    ) -> None:
        self.reference = reference
        self.endpoint = endpoint
        self.workers = workers
        self.timeout_s = timeout_s
        self.retries = retries
        self.env = env or {}
        self.on_exit = on_exit
        self.reward_sink = reward_sink  # unused: workers emit rewards themselves over OTLP
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._context = mp.get_context("spawn")  # never fork a process that holds torch threads
        self._workers: list[_Worker] = []
        self._futures: dict[int, asyncio.Future[_Result]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def _worker_env(self) -> dict[str, str]:
        env = dict(self.env)
        if self.endpoint.otlp_endpoint:
            env[semconv.ENV_OTLP_ENDPOINT] = self.endpoint.otlp_endpoint
        env.update(self.endpoint.extra_env)
        return env

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threads = max(1, math.ceil(self._concurrency / self.workers))
        self._threads = threads
        self._workers = [_Worker(self._context, self.reference, self._worker_env(), threads) for _ in range(self.workers)]
        await asyncio.to_thread(self._await_ready)
        for worker in self._workers:
            self._start_reader(worker)
        asyncio.get_running_loop().create_task(self._watch_workers())

    def _spawn(self) -> _Worker:
        worker = _Worker(self._context, self.reference, self._worker_env(), self._threads)
        self._start_reader(worker)
        return worker

    def _await_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for worker in self._workers:
            try:
                if not worker.results.poll(max(0.1, deadline - time.monotonic())):
                    raise HarnessNotFound(f"runner workers did not start within {READY_TIMEOUT_S:.0f} s")
                message = worker.results.recv()
            except (EOFError, OSError):
                message = ("failed", f"the worker exited while starting (exit code {worker.process.exitcode})")
            except HarnessNotFound:
                self._terminate_all()
                raise
            if message[0] == "failed":
                self._terminate_all()
                raise HarnessNotFound(f"runner worker could not load {self.reference!r}: {message[1]}")

    def _start_reader(self, worker: _Worker) -> None:
        worker.reader = threading.Thread(
            target=self._read_results, args=(worker,), name=f"agl-runner-results-{worker.process.pid}", daemon=True
        )
        worker.reader.start()

    def _read_results(self, worker: _Worker) -> None:
        """One worker's results, until it exits (EOF)."""
        while True:
            try:
                item = worker.results.recv()
            except (EOFError, OSError):
                return
            if isinstance(item, _Result) and self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                    self._loop.call_soon_threadsafe(self._resolve, item)
            elif isinstance(item, tuple) and item[0] == "failed":
                log.error("a replacement runner worker failed to start: %s", item[1])

    def _resolve(self, result: _Result) -> None:
        for worker in self._workers:
            worker.pending.discard(result.request_id)
        future = self._futures.pop(result.request_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def _watch_workers(self) -> None:
        """Replace dead workers; their rollouts end as infrastructure errors (and are retried)."""
        while not self._stopping:
            await asyncio.sleep(0.2)
            for index, worker in enumerate(self._workers):
                if worker.process.is_alive() or self._stopping:
                    continue
                for request_id in list(worker.pending):
                    future = self._futures.pop(request_id, None)
                    if future is not None and not future.done():
                        message = f"runner worker {worker.process.pid} died (exit code {worker.process.exitcode})"
                        future.set_result(_Result(request_id, Cause.INFRA_ERROR.value, None, message, 0.0))
                worker.discard_queue()
                # Requests queue up in the new worker until it has imported the harness.
                self._workers[index] = self._spawn()

    async def run(self, spec: RolloutSpec) -> RolloutOutcome:
        async with self._slots:
            return await run_with_retries(self._attempt, spec, self.retries, stopping=lambda: self._stopping)

    async def _attempt(self, spec: RolloutSpec) -> RolloutOutcome:
        assert self._loop is not None, "FunctionRunner.start() first"
        request_id = next(self._ids)
        future: asyncio.Future[_Result] = self._loop.create_future()
        self._futures[request_id] = future
        worker = min(self._workers, key=lambda w: len(w.pending))
        worker.pending.add(request_id)
        worker.requests.put(_Request(request_id, spec, self.endpoint.base_url(spec)))
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            outcome = RolloutOutcome(spec, Cause(result.cause), reward=result.reward, message=result.message)
        except asyncio.TimeoutError:
            outcome = RolloutOutcome(spec, Cause.TIMEOUT, message=f"still running after {self.timeout_s:g} s")
        finally:  # timed out or cancelled: a late result is ignored
            if self._futures.pop(request_id, None) is not None:
                worker.abandoned += 1
            worker.pending.discard(request_id)
        outcome.seconds = time.monotonic() - started
        await call_hook(self.on_exit, outcome)
        return outcome

    async def stop(self) -> None:
        self._stopping = True
        for worker in self._workers:
            with contextlib.suppress(Exception):
                worker.requests.put(None)
        await asyncio.to_thread(self._join_all)
        for worker in self._workers:  # exited workers: their readers saw EOF
            if worker.reader is not None:
                await asyncio.to_thread(worker.reader.join, 5.0)
                if worker.reader.is_alive():
                    continue  # never close a pipe under a thread still reading it
            worker.results.close()
        for future in self._futures.values():
            if not future.done():
                future.cancel()

    def _join_all(self) -> None:
        deadline = time.monotonic() + 5.0
        for worker in self._workers:
            if worker.abandoned:
                continue  # a hung harness thread would hold it up: killed below
            worker.process.join(max(0.0, deadline - time.monotonic()))
        self._terminate_all()

    def _terminate_all(self) -> None:
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(2.0)
            worker.discard_queue()
