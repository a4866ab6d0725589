"""A soak: agl-sidecar, an OTLP collector and the trainer's receiver (its SQLite store) under mixed
load for minutes, with faults on a schedule, and an account of every call at the end.

    python bench/soak.py [--minutes M] [--workers W] [--plain] [--quick]

Processes, all real, over loopback: the engine (testing/agl_testing/fake_vllm.py, vLLM's wire
format, behind a byte relay that can answer as a hostile engine does); `agl-sidecar
--durable-spans` (`--plain`: without); a collector (an OTLP/HTTP pass-through that can be stopped or
slowed); the receiver and its store. W harness workers run rollouts of 4 calls (streamed and
unary, the conversation growing), then a reward and an end, over and over; each call names its
turn in `x-agl-agent-id`, so the store says which span is which call.

Faults, in turn, one a slot (a cycle of 8 slots over the run; --quick: one cycle in about 100 s):
normal, collector down (stopped), normal, collector slow (every export waits 3 s), sidecar SIGKILL
(restarted 1 s later on its port and spool), receiver SIGKILL (restarted 1 s later on its store),
hostile engine answers (every 4th request: a header that never ends, an unrequested gzip body, a
close-delimited body cut by a reset, bytes that are not HTTP), normal.

Every interval it prints calls answered, calls failed, spans stored, the sidecar's spool and the
RSS of the sidecar and the receiver. At the end (faults off, a drained pause until the sidecar says
every span is delivered) it counts, per call: answered and stored (ok), answered and not stored
(lost), failed but stored as completed (a span for an answer the harness never got), failed and
stored as `delivery_unknown` (a durable span whose delivery the killed sidecar could not prove:
not trained unless a later call builds on it), failed and stored as an upstream error (hostile
answers: recorded, not trained); and the duplicates the receiver skipped (replays after the
kills). Exit status 1 when an answered call's span was lost (or, in durable mode, a failed call's
span was stored as completed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _load import RECEIVER, free_port, stop_processes, wait_up
from sidecar_overhead import rss_mb

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CALLS_PER_ROLLOUT = 4

# The engine: FakeVLLM on an inner port, and in front of it a relay that passes each request on, or,
# while hostile (SIGUSR1 toggles), answers every 4th request as a hostile engine and closes.
ENGINE = r"""
import asyncio, gzip, json, signal, socket, struct, sys
sys.path.insert(0, {root!r})
import uvloop
from aiohttp import web
from agl_testing.fake_vllm import FakeVLLM

HOSTILE = [False]
COUNT = [0]
BODY = json.dumps({{"id": "x", "object": "chat.completion", "choices": []}}).encode()

async def answer_hostile(writer, kind):
    if kind == 0:  # a header that never ends: the sidecar must cut it at its bound
        writer.write(b"HTTP/1.1 200 OK\r\nx-filler: ")
        try:
            for _ in range(100_000):
                writer.write(b"a" * 4096)
                await writer.drain()
        except (ConnectionError, OSError):
            return
    elif kind == 1:  # gzip though the sidecar asked for identity
        data = gzip.compress(BODY)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                     b"content-length: %d\r\n\r\n" % len(data) + data)
    elif kind == 2:  # a body delimited by the close, cut by a reset
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + BODY[:10])
        await writer.drain()
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return
    else:  # not HTTP at all
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
    try:
        await writer.drain()
    except (ConnectionError, OSError):
        pass
    writer.close()

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.CancelledError):
        pass
    finally:
        writer.close()

async def client(reader, writer, inner):
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", inner)
    back = asyncio.create_task(pipe(up_reader, writer))
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            COUNT[0] += 1
            if HOSTILE[0] and COUNT[0] % 4 == 0:
                back.cancel()
                up_writer.close()
                await answer_hostile(writer, (COUNT[0] // 4) % 4)
                return
            up_writer.write(head + body)
            await up_writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        back.cancel()
        up_writer.close()
        writer.close()

async def main():
    runner = web.AppRunner(FakeVLLM().build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    inner = site._server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: HOSTILE.__setitem__(0, not HOSTILE[0]))
    server = await asyncio.start_server(lambda r, w: client(r, w, inner), "127.0.0.1", {port})
    print("engine up", flush=True)
    await server.serve_forever()

uvloop.run(main())
"""

# An OTLP/HTTP collector in the sidecar's path: passes requests to the receiver as they came,
# each after DELAY seconds (slow), answering 503 while the receiver is away.
COLLECTOR = r"""
import asyncio, uvloop, aiohttp
from aiohttp import web
DELAY, UP = {delay}, {receiver!r}
async def start(app):
    app["s"] = aiohttp.ClientSession()
async def stop(app):
    await app["s"].close()
async def traces(request):
    body = await request.read()
    if DELAY:
        await asyncio.sleep(DELAY)
    headers = {{k: v for k, v in request.headers.items() if k.lower() in ("content-type", "content-encoding", "authorization")}}
    try:
        async with request.app["s"].post(UP + "/v1/traces", data=body, headers=headers) as reply:
            data = await reply.read()
            return web.Response(status=reply.status, body=data, content_type=reply.content_type)
    except aiohttp.ClientError:
        return web.Response(status=503, text="receiver unreachable")
app = web.Application(client_max_size=1 << 28)
app.on_startup.append(start)
app.on_cleanup.append(stop)
app.router.add_post("/v1/traces", traces)
async def healthz(request):
    return web.Response(text="ok")
app.router.add_get("/healthz", healthz)
web.run_app(app, host="127.0.0.1", port={port}, access_log=None, print=None, loop=uvloop.new_event_loop())
"""


SLOTS = ("normal", "collector down", "normal", "collector slow", "sidecar SIGKILL", "receiver SIGKILL",
         "hostile engine", "normal")  # fmt: skip


@dataclass
class Ledger:
    """What the harness saw of each call: (rollout, turn) -> answered, and failures by cause."""

    answered: set[tuple[str, str]] = field(default_factory=set)
    failed: dict[tuple[str, str], str] = field(default_factory=dict)
    rewards_sent: int = 0

    def fail(self, key: tuple[str, str], why: str) -> None:
        self.failed[key] = why[:60]


class Cluster:
    """The processes, their ports and how each is stopped and started again."""

    def __init__(self, work: Path, durable: bool) -> None:
        self.work = work
        self.durable = durable
        self.ports = {name: free_port() for name in ("engine", "sidecar", "collector", "receiver")}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.url = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.duplicates = 0  # skipped by every receiver incarnation, read before each is killed

    def start(self, name: str, **options: Any) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - the process holds it
        if name == "engine":
            args = [PY, "-c", ENGINE.format(root=str(ROOT), port=self.ports["engine"])]
        elif name == "collector":
            args = [PY, "-c", COLLECTOR.format(delay=options.get("delay", 0.0), receiver=self.url["receiver"],
                                               port=self.ports["collector"])]  # fmt: skip
        elif name == "receiver":
            store = str(self.work / "rollouts.db")
            args = [PY, "-c", RECEIVER.format(root=str(ROOT), store=store, port=self.ports["receiver"])]
        else:
            args = [PY, "-m", "agl_sidecar.cli", "--upstream", self.url["engine"], "--listen",
                    f"127.0.0.1:{self.ports['sidecar']}", "--otlp-endpoint", self.url["collector"], "--spool-dir",
                    str(self.work / "spool"), *(["--durable-spans"] if self.durable else [])]  # fmt: skip
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)

    def rss(self, name: str) -> float:
        proc = self.procs.get(name)
        return rss_mb(proc.pid) if proc is not None and proc.poll() is None else float("nan")

    def close(self) -> None:
        stop_processes(list(self.procs.values()), 15)
        self.procs.clear()


async def harness(session: Any, base: str, worker: int, ledger: Ledger, stop: asyncio.Event) -> None:
    """Rollouts of CALLS_PER_ROLLOUT calls, each turn named in x-agl-agent-id, then a reward and an end."""
    import aiohttp

    rollout = 0
    while not stop.is_set():
        rid = f"soak-{worker}-{rollout}"
        rollout += 1
        content = f"worker {worker} rollout {rollout}: solve the task"
        for turn in range(CALLS_PER_ROLLOUT):
            stream = turn % 2 == 1
            key = (rid, f"t{turn}")
            payload = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16,
                       "stream": stream}  # fmt: skip
            try:
                async with session.post(f"{base}/rollouts/{rid}/v1/chat/completions", json=payload,
                                        headers={"x-agl-agent-id": key[1]}) as reply:  # fmt: skip
                    data = await reply.read()
                    if reply.status != 200:
                        ledger.fail(key, f"HTTP {reply.status}")
                    elif stream and b"[DONE]" not in data[-64:]:
                        ledger.fail(key, "stream without [DONE]")
                    else:
                        ledger.answered.add(key)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                ledger.fail(key, type(exc).__name__)
                await asyncio.sleep(0.2)  # a harness that lost its connection tries the next turn shortly
            content += f" then step {turn}"
        for path, body in (("reward", {"value": 1.0}), ("end", {"status": "succeeded"})):
            try:
                async with session.post(f"{base}/rollouts/{rid}/{path}", json=body) as reply:
                    await reply.read()
                    ledger.rewards_sent += reply.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass


async def receiver_duplicates(session: Any, url: str) -> int:
    try:
        async with session.get(url + "/stats") as reply:
            return int((await reply.json()).get("duplicates", 0))
    except Exception:  # noqa: BLE001 - it is down: counted at its last reading
        return 0


async def sidecar_state(session: Any, url: str) -> dict[str, Any]:
    try:
        async with session.get(url + "/agl/v1/state") as reply:
            return (await reply.json()).get("counters", {})
    except Exception:  # noqa: BLE001 - it is down (killed) between readings
        return {}


def stored_calls(store: Path) -> dict[tuple[str, str], str]:
    """(rollout, turn) -> end reason of every call span stored for the soak's rollouts."""
    if not store.exists():
        return {}
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT rollout_id, agent_id, end_reason FROM calls WHERE rollout_id LIKE 'soak-%'")
        return {(rollout, turn): reason for rollout, turn, reason in rows}


async def run(minutes: float, workers: int, durable: bool, quick: bool) -> int:
    import aiohttp

    work = Path(tempfile.mkdtemp(prefix="agl-bench-soak-"))
    cluster = Cluster(work, durable)
    slot_s = 12.0 if quick else max(10.0, minutes * 60 / (8 * max(1, round(minutes / 4))))
    total_s = 8 * slot_s if quick else minutes * 60
    interval_s = 10.0 if quick else 60.0
    ledger = Ledger()
    try:
        for name in ("engine", "receiver", "collector", "sidecar"):
            cluster.start(name)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            await wait_up(cluster.url["receiver"] + "/healthz", session)
            await wait_up(cluster.url["collector"] + "/healthz", session)
            await wait_up(cluster.url["sidecar"] + "/healthz", session)
            stop = asyncio.Event()
            load = [asyncio.create_task(harness(session, cluster.url["sidecar"], w, ledger, stop)) for w in range(workers)]
            started = time.monotonic()
            print(f"soak: {workers} workers, {'durable' if durable else 'plain'} sidecar, {total_s / 60:.1f} min, "
                  f"slots of {slot_s:.0f} s: {', '.join(SLOTS)}; load {os.getloadavg()[0]:.2f} at start", flush=True)
            print(f"{'t s':>6} {'fault':<17}{'answered':>9}{'failed':>8}{'stored':>8}{'spool':>7}"
                  f"{'sidecar MB':>11}{'receiver MB':>12}", flush=True)
            next_print = 0.0
            slot = 0
            faults: dict[str, int] = {}
            while time.monotonic() - started < total_s:
                fault = SLOTS[slot % len(SLOTS)]
                slot_end = started + (slot + 1) * slot_s
                faults[fault] = faults.get(fault, 0) + 1
                await apply(cluster, session, fault, start=True)
                while time.monotonic() < min(slot_end, started + total_s):
                    now = time.monotonic() - started
                    if now >= next_print:
                        state = await sidecar_state(session, cluster.url["sidecar"])
                        print(f"{now:6.0f} {fault:<17}{len(ledger.answered):>9}{len(ledger.failed):>8}"
                              f"{len(stored_calls(work / 'rollouts.db')):>8}{state.get('spans_in_spool', '-'):>7}"
                              f"{cluster.rss('sidecar'):11.0f}{cluster.rss('receiver'):12.0f}", flush=True)
                        next_print = now + interval_s
                    await asyncio.sleep(0.5)
                await apply(cluster, session, fault, start=False)
                slot += 1
            stop.set()
            await asyncio.gather(*load)
            delivered = await settle(session, cluster.url["sidecar"])
            cluster.duplicates += await receiver_duplicates(session, cluster.url["receiver"])
            state = await sidecar_state(session, cluster.url["sidecar"])
        return report(ledger, stored_calls(work / "rollouts.db"), cluster, state, delivered, faults, durable,
                      time.monotonic() - started)  # fmt: skip
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)


async def apply(cluster: Cluster, session: Any, fault: str, start: bool) -> None:
    """Begin (`start`) or end one slot's fault."""
    if fault == "collector down":
        if start:
            cluster.stop("collector", signal.SIGKILL)
        else:
            cluster.start("collector")
            await wait_up(cluster.url["collector"] + "/healthz", session)
    elif fault == "collector slow":
        cluster.stop("collector", signal.SIGKILL)
        cluster.start("collector", delay=3.0 if start else 0.0)
        await wait_up(cluster.url["collector"] + "/healthz", session)
    elif fault == "sidecar SIGKILL" and start:
        cluster.stop("sidecar", signal.SIGKILL)
        await asyncio.sleep(1.0)
        cluster.start("sidecar")
        await wait_up(cluster.url["sidecar"] + "/healthz", session)
    elif fault == "receiver SIGKILL" and start:
        cluster.duplicates += await receiver_duplicates(session, cluster.url["receiver"])
        cluster.stop("receiver", signal.SIGKILL)
        await asyncio.sleep(1.0)
        cluster.start("receiver")
        await wait_up(cluster.url["receiver"] + "/healthz", session)
    elif fault == "hostile engine":
        cluster.procs["engine"].send_signal(signal.SIGUSR1)  # on at the start, off at the end


async def settle(session: Any, url: str, timeout_s: float = 180.0) -> bool:
    """A drained pause, until the sidecar says every span is delivered (or `timeout_s`); resumed."""
    deadline = time.monotonic() + timeout_s
    flushed = False
    while not flushed and time.monotonic() < deadline:
        async with session.post(url + "/agl/v1/pause", json={"drain": True, "timeout_s": 30}) as reply:
            flushed = bool((await reply.json()).get("spans_flushed"))
        if not flushed:
            await asyncio.sleep(1.0)
    async with session.post(url + "/agl/v1/resume", json={}) as reply:
        await reply.read()
    return flushed


def report(
    ledger: Ledger, stored: dict[tuple[str, str], str], cluster: Cluster, state: dict[str, Any], delivered: bool,
    faults: dict[str, int], durable: bool, seconds: float,
) -> int:
    answered = ledger.answered
    lost = sorted(key for key in answered if key not in stored)
    failed = {key: why for key, why in ledger.failed.items() if key not in answered}
    by_end: dict[str, int] = {}
    for key in failed:
        reason = stored.get(key, "not stored")
        by_end[reason] = by_end.get(reason, 0) + 1
    causes: dict[str, int] = {}
    for why in failed.values():
        causes[why] = causes.get(why, 0) + 1
    unknown_answered = sum(1 for key in answered if stored.get(key) == "delivery_unknown")
    print()
    print(f"soak: {seconds / 60:.1f} min; faults {faults}; load {os.getloadavg()[0]:.2f} at the end "
          f"(1-min average, the machine is shared)")
    print(f"calls answered {len(answered)}; spans stored for them {len(answered) - len(lost)}; spans lost "
          f"{len(lost)}{' ' + str(lost[:5]) if lost else ''}")
    print(f"calls the harness saw fail {len(failed)} (by cause {causes}); their spans: {by_end}")
    print(f"answered calls stored as delivery_unknown (killed before their marker was written) {unknown_answered}")
    print(f"duplicates the receiver skipped (replays after kills) {cluster.duplicates}; rewards+ends answered "
          f"{ledger.rewards_sent}")
    print(f"sidecar at the end: delivered {delivered}, spans_failed {state.get('spans_failed')}, dead-lettered "
          f"{state.get('spans_dead_lettered')}, in spool {state.get('spans_in_spool')}")
    bad = bool(lost) or (durable and by_end.get("completed", 0) > 0)
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    parser.add_argument("--workers", type=int, help="concurrent harness workers (default 32, 16 with --quick)")
    parser.add_argument("--plain", action="store_true", help="the sidecar without --durable-spans")
    parser.add_argument("--quick", action="store_true", help="one cycle of the faults, about 100 s")
    args = parser.parse_args()
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import uvloop

    return uvloop.run(run(args.minutes, args.workers or (16 if args.quick else 32), not args.plain, args.quick))


if __name__ == "__main__":
    sys.exit(main())
