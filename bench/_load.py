"""Load generation shared by the proxy benchmarks: free ports, waiting for a server, timed calls
in blocks at a given concurrency, and percentiles."""

from __future__ import annotations

import asyncio
import subprocess
import time
from typing import Any

from agl_trainer.addresses import free_port  # noqa: F401 - the benches take it from here

JSON = {"Content-Type": "application/json"}

# The trainer's receiver and its store, as a process of its own: RECEIVER.format(root=, store=, port=)
RECEIVER = """
import sys, time
sys.path.insert(0, {root!r})
from agl_trainer.receiver import Receiver, ReceiverConfig
with Receiver({store!r}, ReceiverConfig(port={port}, grpc_port=0)):
    print("receiver up", flush=True)
    while True:
        time.sleep(3600)
"""


async def wait_up(url: str, session: Any, timeout_s: float = 60.0) -> None:
    """Return once GET `url` answers (any status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as reply:
                await reply.read()
                return
        except Exception:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


async def one_call(session: Any, url: str, body: bytes, stream: bool, headers: dict[str, str] = JSON) -> float:
    """Seconds for one POST, read to the end (a stream chunk by chunk); RuntimeError unless 200."""
    started = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status}: {(await reply.text())[:300]}")
        if stream:
            async for _ in reply.content.iter_any():
                pass
        else:
            await reply.read()
    return time.perf_counter() - started


async def run_block(
    session: Any,
    url: str,
    body: bytes | list[bytes],
    stream: bool,
    calls: int,
    concurrency: int,
    headers: dict[str, str] = JSON,
    first: int = 0,
) -> tuple[list[float], float]:
    """`calls` calls, `concurrency` at a time: (latencies, wall seconds). A list of bodies is sent in
    turn from `first`, one per call."""
    latencies: list[float] = []
    remaining = calls
    bodies = body if isinstance(body, list) else [body]
    turn = first

    async def worker() -> None:
        nonlocal remaining, turn
        while remaining > 0:
            remaining -= 1
            next_body = bodies[turn % len(bodies)]
            turn += 1
            latencies.append(await one_call(session, url, next_body, stream, headers))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Terminate `procs` together, then wait for each; one still running after `timeout_s` is killed."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
