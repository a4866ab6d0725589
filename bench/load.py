"""Many concurrent streaming rollouts through agl-sidecar, every span counted at a real receiver.

    python bench/load.py [--rollouts N] [--calls K] [--quick]

Over loopback, in one run: the stand-in engine (testing/agl_testing/fake_vllm.py, vLLM's wire format);
"direct" (the client asks the engine for token IDs itself); the floor (a bare aiohttp pass-through
that asks for token IDs and strips them: bench/sidecar_overhead.py's); agl-sidecar and agl-sidecar
--durable-spans, both exporting to the trainer's real OTLP receiver (its SQLite store).

Three phases, the targets interleaved in blocks within each (a machine shared with other work runs
every target equally slow):
  c=1   calls one at a time: added p50/p99 latency against direct (what --durable-spans costs a call)
  c=64  64 streams at once: throughput, and the ratio against the floor
  load  N rollouts at once (default 1,000), K streaming calls each, and through the sidecars a reward
        and an end per rollout (not in its calls/s, but in its wall time):
        errors, p50/p99 added latency, sidecar RSS before/after, and spans stored / spans sent
        (counted in the receiver's store after a drained pause; must be 1.0)
Bounded: every call has a timeout, the whole run a deadline; --quick finishes in under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _load import JSON, RECEIVER, free_port, pct, wait_up
from sidecar_overhead import FAKE, FLOOR, rss_mb

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


SIDECARS = ("agl-sidecar", "agl-durable")


async def call(session: Any, url: str, body: bytes, stream: bool) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=JSON) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
        if stream:
            tail = b""
            async for part in reply.content.iter_any():
                tail = (tail + part)[-64:]
            if b"[DONE]" not in tail:
                raise RuntimeError("stream ended without [DONE]")
        else:
            await reply.read()
    return time.perf_counter() - started


def body(stream: bool, with_ids: bool, content: str) -> bytes:
    import msgspec

    value: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 16,
                             "stream": stream}
    if with_ids:
        value.update(return_token_ids=True, logprobs=True, top_logprobs=0)
    return msgspec.json.encode(value)


class Tally:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.calls = 0  # calls through a sidecar that got a 200 (each must give a stored span)
        self.extra_spans = 0  # rewards and ends sent (spans too)
        self.wall_s = 0.0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall_s if self.wall_s else float("nan")

    def error(self, why: str) -> None:
        self.errors[why[:80]] = self.errors.get(why[:80], 0) + 1


async def rollout(
    session: Any, base: str, prefix: str, index: int, calls: int, tally: Tally, sidecar: bool, with_ids: bool,
    finish: bool,
) -> None:
    """`calls` streaming calls in turn; with `finish` (through a sidecar), then a reward and an end."""
    rid = f"{prefix}-{index}"
    url = f"{base}/rollouts/{rid}/v1/chat/completions" if sidecar else f"{base}/v1/chat/completions"
    content = f"rollout {index}: solve the task"
    for turn in range(calls):
        try:
            tally.latencies.append(await call(session, url, body(True, with_ids, content), True))
            tally.calls += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
            tally.error(f"{type(exc).__name__}: {exc}")
        content += f" then step {turn}"
    if sidecar and finish:
        for path, payload in (("reward", b'{"value": 1.0}'), ("end", b'{"status": "succeeded"}')):
            try:
                async with session.post(f"{base}/rollouts/{rid}/{path}", data=payload, headers=JSON) as reply:
                    await reply.read()
                    if reply.status == 200:
                        tally.extra_spans += 1
                    else:
                        tally.error(f"{path}: HTTP {reply.status}")
            except Exception as exc:  # noqa: BLE001
                tally.error(f"{path}: {type(exc).__name__}: {exc}")


async def main(rollouts: int, calls: int, quick: bool, deadline_s: float) -> int:
    import aiohttp

    run_deadline = time.monotonic() + deadline_s
    work = Path(tempfile.mkdtemp(prefix="agl-bench-load-"))
    store = work / "rollouts.db"
    ports = {name: free_port() for name in ("engine", "floor", "receiver", *SIDECARS)}
    engine = f"http://127.0.0.1:{ports['engine']}"
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["engine"] = subprocess.Popen([PY, "-c", FAKE.format(root=str(ROOT), port=ports["engine"])])
        procs["floor"] = subprocess.Popen([PY, "-c", FLOOR.format(upstream=engine, port=ports["floor"])])
        procs["receiver"] = subprocess.Popen(
            [PY, "-c", RECEIVER.format(root=str(ROOT), store=str(store), port=ports["receiver"])],
            stdout=subprocess.DEVNULL,
        )
        for name in SIDECARS:
            args = [PY, "-m", "agl_sidecar.cli", "--upstream", engine, "--listen", f"127.0.0.1:{ports[name]}",
                    "--otlp-endpoint", f"http://127.0.0.1:{ports['receiver']}", "--spool-dir", str(work / "spool")]
            if name == "agl-durable":
                args.append("--durable-spans")
            procs[name] = subprocess.Popen(args, stdout=subprocess.DEVNULL, cwd=ROOT)
        urls = {
            "direct": engine,
            "floor": f"http://127.0.0.1:{ports['floor']}",
            **{name: f"http://127.0.0.1:{ports[name]}" for name in SIDECARS},
        }
        limit = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=limit, timeout=aiohttp.ClientTimeout(total=120)) as session:
            await wait_up(engine + "/health", session)
            await wait_up(urls["floor"] + "/v1/chat/completions", session)
            for name in SIDECARS:
                await wait_up(urls[name] + "/healthz", session)
            sent = {name: Tally() for name in SIDECARS}  # every call through a sidecar, all phases

            print(f"{'phase':<8}{'target':<14}{'calls':>7}{'errors':>7}{'p50 ms':>9}{'p99 ms':>9}"
                  f"{'+p50 ms':>9}{'+p99 ms':>9}{'calls/s':>9}")

            async def phase(
                label: str, concurrency: int, per_target: int, blocks: int, k: int, finish: bool = False
            ) -> dict[str, Tally]:
                tallies = {name: Tally() for name in urls}
                per_block = max(1, per_target // blocks)
                for block in range(blocks):
                    for name, base in urls.items():
                        if time.monotonic() > run_deadline:
                            raise TimeoutError("the run's deadline passed")
                        sidecar = name in SIDECARS
                        tally = tallies[name]
                        started = time.perf_counter()
                        # `concurrency` rollouts at once, each `k` calls in turn
                        first = block * per_block
                        for start in range(first, first + per_block, concurrency):
                            await asyncio.gather(*(
                                rollout(session, base, f"{label}-{name}", i, k, tally, sidecar, name == "direct", finish)
                                for i in range(start, min(start + concurrency, first + per_block))
                            ))
                        tally.wall_s += time.perf_counter() - started
                base50, base99 = pct(tallies["direct"].latencies, 0.5), pct(tallies["direct"].latencies, 0.99)
                for name, tally in tallies.items():
                    p50, p99 = pct(tally.latencies, 0.5), pct(tally.latencies, 0.99)
                    print(f"{label:<8}{name:<14}{len(tally.latencies):>7}{sum(tally.errors.values()):>7}"
                          f"{p50 * 1e3:9.2f}{p99 * 1e3:9.2f}{(p50 - base50) * 1e3:9.2f}{(p99 - base99) * 1e3:9.2f}"
                          f"{tally.rate:9.1f}")
                    if name in sent:
                        sent[name].calls += tally.calls
                        sent[name].extra_spans += tally.extra_spans
                return tallies

            one = await phase("c1", 1, 100 if quick else 400, 4 if quick else 8, 1)
            wide = await phase("c64", 64, 256 if quick else 1024, 2 if quick else 4, 1)
            rss_before = {name: rss_mb(procs[name].pid) for name in SIDECARS}
            load = await phase("load", rollouts, rollouts, 1, calls, finish=True)
            rss_after = {name: rss_mb(procs[name].pid) for name in SIDECARS}

            def added(tallies: dict[str, Tally], name: str) -> float:
                return pct(tallies[name].latencies, 0.5) - pct(tallies["direct"].latencies, 0.5)

            print()
            floor_added = added(one, "floor")
            for name in SIDECARS:
                print(f"{name}: added p50 at c=1 {added(one, name) * 1e3:.2f} ms ({added(one, name) / floor_added:.2f}x "
                      f"the floor's {floor_added * 1e3:.2f} ms)")
            durable_cost = added(one, "agl-durable") - added(one, "agl-sidecar")
            print(f"--durable-spans: +{durable_cost * 1e3:.2f} ms p50 per call at c=1; p99 "
                  f"{pct(one['agl-durable'].latencies, 0.99) * 1e3:.2f} vs {pct(one['agl-sidecar'].latencies, 0.99) * 1e3:.2f} ms")
            print("throughput at c=64 against the floor's: " + ", ".join(
                f"{name} {wide[name].rate / wide['floor'].rate:.0%}" for name in SIDECARS)
                + f"; --durable-spans against plain: {wide['agl-durable'].rate / wide['agl-sidecar'].rate:.0%}")
            for name in SIDECARS:
                print(f"{name} RSS: {rss_before[name]:.0f} MB before the load phase, {rss_after[name]:.0f} MB after")
            errors = {name: tally.errors for name, tally in {**one, **wide, **load}.items() if tally.errors}
            print(f"errors: {errors or 'none'}")

            # Every span the sidecars were sent must be stored: drain, deliver, then count.
            for name in SIDECARS:
                async with session.post(urls[name] + "/agl/v1/pause", json={"drain": True, "timeout_s": 60}) as reply:
                    state = await reply.json()
                print(f"{name}: drained pause: spans_flushed={state.get('spans_flushed')}, "
                      f"in spool {state.get('spans_in_spool')}, failed {state.get('spans_failed')}")
        failed = 1 if any(t.errors for t in (*one.values(), *wide.values(), *load.values())) else 0
        with sqlite3.connect(store) as db:
            for name in SIDECARS:
                stored_calls = db.execute("select count(*) from calls where rollout_id like ?", (f"%-{name}-%",)).fetchone()[0]
                stored_rewards = db.execute(
                    "select count(*) from rewards where rollout_id like ?", (f"%-{name}-%",)).fetchone()[0]
                stored_ends = db.execute(
                    "select count(*) from rollout_spans where rollout_id like ?", (f"%-{name}-%",)).fetchone()[0]
                made = sent[name].calls
                ratio = stored_calls / made if made else float("nan")
                print(f"{name}: call spans stored / calls answered = {stored_calls}/{made} = {ratio:.4f}; "
                      f"reward+end spans stored {stored_rewards + stored_ends}/{sent[name].extra_spans}")
                if stored_calls != made or stored_rewards + stored_ends != sent[name].extra_spans:
                    failed = 1
        return failed
    finally:
        for name in (*SIDECARS, "floor", "engine", "receiver"):
            proc = procs.get(name)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, help="concurrent rollouts in the load phase (default 1000, 200 with --quick)")
    parser.add_argument("--calls", type=int, help="streaming calls per rollout in the load phase (default 5, 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a small run (under a minute)")
    parser.add_argument("--deadline-s", type=float, default=900.0, help="give up after this long (default 900)")
    args = parser.parse_args()
    n = args.rollouts or (200 if args.quick else 1000)
    k = args.calls or (2 if args.quick else 5)
    if n < 1 or k < 1:
        parser.error("--rollouts and --calls must be at least 1")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import uvloop

    sys.exit(uvloop.run(main(n, k, args.quick, args.deadline_s)))
