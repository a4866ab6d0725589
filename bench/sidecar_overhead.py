"""What agl-sidecar adds to a model call, against a minimal pass-through proxy (the floor).

    python bench/sidecar_overhead.py [--quick] [--peers] [--lean-floor] [--case TEXT]... [--blocks N] [--spelling S]

Over loopback, in one run: a fake vLLM upstream (testing/agl_testing/fake_vllm.py, vLLM's wire format);
"direct" (the client asks the engine for token IDs itself); the floor (aiohttp + uvloop + orjson,
written below: forwards, asks for token IDs, reads and strips them); agl-sidecar (exporting spans to an
OTLP receiver); "agl-declared", the same sidecar called with the structure a harness declares
(Claude Code's agent-id headers, a W3C traceparent and baggage), which it validates and records. Prompts
of 2k and 30k characters, streaming and not, concurrency 1 and 64. Targets are interleaved in small
blocks, since a call right after a slow one runs slow on a shared machine. Prints added p50/p99 latency
against direct, throughput, RSS, the ratios against the floor, and declared structure's cost.

With --lean-floor, "floor-lean" joins: the floor with its upstream call made by agl-sidecar's own engine
client (agl_sidecar/proxy/engine_client.py) instead of aiohttp's ClientSession, so what the sidecar's
own work costs shows apart from what its leaner client saves.

With --spelling spaced, the fake vLLM writes its JSON as other servers and re-serializing gateways do
(`{"id": "x", "choices": [...]}`: a space after every colon and comma) instead of vLLM's compact
bytes; --spelling both runs the whole bench once per spelling, each against its own floor.

With --peers, real peer proxies join the same interleaved blocks: the litellm proxy (one worker, the
model routed to the fake vLLM as hosted_vllm, the client asking for token IDs as it does direct) and
Agent Lightning's gateway (`agl-server`, train mode, which adds token IDs and logprobs itself). They
are installed into throwaway venvs under /tmp by scripts/setup_bench_peers.sh (run first; a no-op
once done). A peer that cannot be installed, started or called for a case is reported and skipped.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import _peers  # bench/_peers.py (bench/ is on sys.path when this runs as a script)
from _load import JSON, free_port, pct, run_block, stop_processes, wait_up

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# What a harness such as Claude Code declares on each call: a sub-agent under the main agent, in a trace.
DECLARED = {
    "x-claude-code-agent-id": "agent-7f3a9c21",
    "x-claude-code-parent-agent-id": "main",
    "traceparent": "00-5b8efff798038103d269b633813fc60c-eee19b7ec3c1b173-01",
    "baggage": "agl.rollout.id=bench-1,agl.task.id=t-1",
}

FAKE = """
import sys, asyncio, uvloop
sys.path.insert(0, {root!r})
from aiohttp import web
from agl_testing import fake_vllm
from agl_testing.fake_vllm import FakeVLLM
if {spaced!r}:  # JSON as Python's json.dumps writes it by default: ", " and ": "
    import json
    fake_vllm._dumps = lambda obj: json.dumps(obj, ensure_ascii=False).encode()
app = FakeVLLM().build_app()
web.run_app(app, host="127.0.0.1", port={port}, access_log=None, print=None, loop=uvloop.new_event_loop())
"""

SINK = """
import uvloop
from aiohttp import web
async def traces(request):  # an OTLP/HTTP span sink: read, acknowledge
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")
app = web.Application(client_max_size=1 << 28)
app.router.add_post("/v1/traces", traces)
web.run_app(app, host="127.0.0.1", port={port}, access_log=None, print=None, loop=uvloop.new_event_loop())
"""

FLOOR = """
import asyncio, orjson, uvloop, aiohttp
from aiohttp import web
UP = {upstream!r}
async def start(app):
    app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
async def stop(app):
    await app["s"].close()
def strip(obj):
    obj["prompt_token_ids"] = None
    for c in obj.get("choices", ()):
        c["token_ids"] = None
        c["logprobs"] = None
async def chat(request):
    body = orjson.loads(await request.read())
    body["return_token_ids"] = True
    body["logprobs"] = True
    body["top_logprobs"] = 0
    async with request.app["s"].post(UP + "/v1/chat/completions", data=orjson.dumps(body),
                                     headers={{"Content-Type": "application/json"}}) as up:
        if not body.get("stream"):
            data = orjson.loads(await up.read())
            tokens = [c.get("token_ids") for c in data["choices"]], data.get("prompt_token_ids")
            strip(data)
            return web.Response(body=orjson.dumps(data), content_type="application/json")
        out = web.StreamResponse(headers={{"Content-Type": "text/event-stream; charset=utf-8"}})
        await out.prepare(request)
        buf = b""
        async for part in up.content.iter_any():
            buf += part
            *events, buf = buf.split(b"\\n\\n")
            chunks = []
            for e in events:
                if e.startswith(b"data: {{"):
                    obj = orjson.loads(e[6:])
                    strip(obj)
                    e = b"data: " + orjson.dumps(obj)
                chunks.append(e + b"\\n\\n")
            await out.write(b"".join(chunks))
        await out.write_eof()
        return out
app = web.Application(client_max_size=1 << 28)
app.router.add_post("/v1/chat/completions", chat)
app.on_startup.append(start)
app.on_cleanup.append(stop)
web.run_app(app, host="127.0.0.1", port={port}, access_log=None, print=None, loop=uvloop.new_event_loop())
"""

# The same floor with its upstream call made by agl-sidecar's own engine client
# (agl_sidecar/proxy/engine_client.py) instead of aiohttp's ClientSession (--lean-floor): what the
# sidecar's own work costs over a pass-through that reaches the engine the same way.
FLOOR_LEAN = FLOOR.replace(
    'app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))',
    "from agl_sidecar.proxy.engine_client import EngineClient\n    app['s'] = EngineClient(timeout_s=None)",
).replace(
    """    async with request.app["s"].post(UP + "/v1/chat/completions", data=orjson.dumps(body),
                                     headers={{"Content-Type": "application/json"}}) as up:""",
    """    up = await request.app["s"].post(UP, "/v1/chat/completions", orjson.dumps(body),
                                     {{"Content-Type": "application/json"}})
    if True:  # the floor's `async with` block, as it is""",
).replace("await up.read()", "await up.read(1 << 28)").replace(
    "async for part in up.content.iter_any():", "while part := await up.readany():"
)
assert "EngineClient" in FLOOR_LEAN and "readany" in FLOOR_LEAN and "read(1 << 28)" in FLOOR_LEAN


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cases() -> list[tuple[str, int, bool, bool, int]]:
    """(name, prompt chars, stream, unique prompts, concurrency) of every case, in the order run.

    The same prompt every call, as the issue's cases; then prompts that never repeat, the worst case
    for the sidecar's cache of token-array slices (an agent resends its whole conversation each
    turn, so real traffic sits between the two)."""
    shapes = [(2000, stream, False) for stream in (False, True)]
    shapes += [(30000, stream, False) for stream in (False, True)]
    shapes += [(30000, False, True)]
    return [
        (f"{chars // 1000}k{' unique' if unique else ''} {'stream' if stream else 'unary'} c={concurrency}",
         chars, stream, unique, concurrency)
        for chars, stream, unique in shapes
        for concurrency in (1, 64)
    ]


CASES = _cases()


def unique_text(chars: int, seed: int) -> str:
    """`chars` characters of words in an order no other seed gives (different token IDs throughout)."""
    words = random.Random(seed).choices(["lorem", "ipsum", "dolor", "sit", "amet", "agent", "tool", "call", "model"], k=chars // 4)
    return " ".join(words)[:chars]


def declared_structure_cpu_us() -> tuple[float, float]:
    """CPU microseconds a call spends reading its identity (calls/attribution.resolve), without and
    with declared structure (best of 5 rounds, so other load hardly moves it)."""
    import timeit

    from agl_sidecar.calls.attribution import resolve

    plain = {"content-type": "application/json", "x-agl-rollout-id": "bench-1", "authorization": "Bearer x"}
    declared = {**plain, **DECLARED}
    rounds = 20_000

    def best(headers: dict[str, str]) -> float:
        timer = timeit.Timer(lambda: resolve(headers, None, None, {}))
        return min(timer.repeat(5, rounds)) / rounds * 1e6

    return best(plain), best(declared)


SPELLINGS = ("vllm", "spaced")


async def main(
    quick: bool,
    with_peers: bool,
    only: list[str] | None = None,
    blocks: int | None = None,
    spelling: str = "vllm",
    lean_floor: bool = False,
) -> None:
    import aiohttp
    import msgspec

    procs: list[subprocess.Popen] = []
    peers: list[_peers.Peer] = []
    peer_dir = _peers.scratch_dir()  # configs and logs of the peers
    fake_port, floor_port, sidecar_port, sink_port = free_port(), free_port(), free_port(), free_port()
    quiet_port = free_port()
    lean_port = free_port()
    upstream = f"http://127.0.0.1:{fake_port}"
    spool = tempfile.mkdtemp(prefix="agl-bench-spool-")
    try:
        print(f"engine JSON spelling: {spelling}")
        spaced = spelling == "spaced"
        procs.append(subprocess.Popen([PY, "-c", FAKE.format(root=str(ROOT), port=fake_port, spaced=spaced)]))
        procs.append(subprocess.Popen([PY, "-c", FLOOR.format(upstream=upstream, port=floor_port)]))
        procs.append(subprocess.Popen([PY, "-c", SINK.format(port=sink_port)]))
        lean = subprocess.Popen([PY, "-c", FLOOR_LEAN.format(upstream=upstream, port=lean_port)]) if lean_floor else None
        if lean is not None:
            procs.append(lean)
        time.sleep(1.0)  # let the other processes finish importing before timing the sidecar's start
        started = time.perf_counter()
        sidecar = subprocess.Popen(
            [PY, "-m", "agl_sidecar.cli", "--upstream", upstream, "--listen", f"127.0.0.1:{sidecar_port}",
             "--otlp-endpoint", f"http://127.0.0.1:{sink_port}", "--spool-dir", spool],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )
        procs.append(sidecar)
        line = sidecar.stdout.readline()  # type: ignore[union-attr]
        ready_s = time.perf_counter() - started
        print(f"agl-sidecar ready in {ready_s:.2f} s ({line.strip()})")
        # The same sidecar without an export endpoint: what span export itself costs.
        procs.append(subprocess.Popen(
            [PY, "-m", "agl_sidecar.cli", "--upstream", upstream, "--listen", f"127.0.0.1:{quiet_port}",
             "--spool-dir", spool], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
        ))
        if with_peers:  # after the sidecar's start is timed: litellm's import takes both cores for seconds
            print("peers:")
            _peers.setup()
            peers, peer_failed = _peers.start_all(upstream, "tiny", peer_dir)
            for name, why in peer_failed.items():
                print(f"  {name}: NOT RUN: {why}")
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
            await wait_up(upstream + "/health", session)
            await wait_up(f"http://127.0.0.1:{floor_port}/v1/chat/completions", session)
            await wait_up(f"http://127.0.0.1:{sidecar_port}/healthz", session)
            await wait_up(f"http://127.0.0.1:{quiet_port}/healthz", session)
            idle_rss = rss_mb(sidecar.pid)
            measured = [("floor", procs[1]), ("agl-sidecar", sidecar)] + ([("floor-lean", lean)] if lean else [])
            cpu_before = {name: cpu_s(p.pid) for name, p in measured}
            calls_made = {"floor": 0, "agl-sidecar": 0, "agl-declared": 0, "floor-lean": 0}
            targets = {
                "direct": upstream + "/v1/chat/completions",
                "floor": f"http://127.0.0.1:{floor_port}/v1/chat/completions",
                "agl-sidecar": f"http://127.0.0.1:{sidecar_port}/v1/chat/completions",
                "agl-noexport": f"http://127.0.0.1:{quiet_port}/v1/chat/completions",
                "agl-declared": f"http://127.0.0.1:{sidecar_port}/v1/chat/completions",
            }
            if lean is not None:
                targets["floor-lean"] = f"http://127.0.0.1:{lean_port}/v1/chat/completions"
                await wait_up(targets["floor-lean"], session)
            headers = {name: JSON for name in targets}
            headers["agl-declared"] = {**JSON, **DECLARED}
            for peer in peers:
                targets[peer.name] = peer.chat_url
                headers[peer.name] = {**JSON, **peer.headers}
                calls_made[peer.name] = 0
                cpu_before[peer.name] = _peers.tree_cpu_s(peer.proc.pid)
            peer_idle_rss = {peer.name: _peers.tree_rss_mb(peer.proc.pid) for peer in peers}
            print(f"idle RSS: agl-sidecar {idle_rss:.0f} MB, floor {rss_mb(procs[1].pid):.0f} MB"
                  + "".join(f", {name} {mb:.0f} MB" for name, mb in peer_idle_rss.items()))
            if not with_peers:
                print("litellm proxy: not run (needs litellm[proxy] in a separate venv; ENVIRONMENT.md measured ~6-16 ms added)")
                print("Agent Lightning gateway: not set up here (optional peer), skipped")
            width = 16 if peers else 13
            header = f"{'case':<24}{'target':<{width}}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}{'req/s':>9}"
            print(header)
            blocks = blocks or (3 if quick else 8)
            for case, chars, stream, unique, concurrency in CASES:
                if only and not any(text in case for text in only):
                    continue
                per_block = (8 if concurrency == 1 else 64) if quick else (48 if concurrency == 1 else 192)
                if chars == 30000 and concurrency == 64:
                    per_block //= 2
                # Unique: a prompt per call of each target, and two more for the warm-up.
                prompts = [unique_text(chars, i) for i in range(per_block * blocks + 2)] if unique else [
                    ("lorem ipsum " * (chars // 12 + 1))[:chars]]
                bodies = {}
                for name, with_ids in (("direct", True), ("floor", False)):
                    bodies[name] = []
                    for content in prompts:
                        plain = {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                 "max_tokens": 32, "stream": stream}
                        if with_ids:
                            plain = {**plain, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
                        bodies[name].append(msgspec.json.encode(plain))
                bodies["agl-sidecar"] = bodies["agl-noexport"] = bodies["agl-declared"] = bodies["floor"]
                bodies["floor-lean"] = bodies["floor"]
                # litellm forwards what the client asks for; Agent Lightning adds token IDs itself.
                bodies["litellm"] = bodies["direct"]
                bodies["agentlightning"] = bodies["floor"]
                case_targets = dict(targets)
                for name, url in targets.items():  # warm-up; a peer that refuses the case sits it out
                    try:
                        await run_block(session, url, bodies[name], stream, 2, 1, headers[name],
                                        first=len(prompts) - 2)
                    except RuntimeError as e:
                        if not any(name == p.name for p in peers):
                            raise
                        print(f"{case:<24}{name:<{width}}NOT RUN: {str(e).split(': ', 1)[-1]}")
                        del case_targets[name]
                lat: dict[str, list[float]] = {t: [] for t in case_targets}
                wall: dict[str, float] = {t: 0.0 for t in case_targets}
                for block in range(blocks):
                    for name, url in case_targets.items():
                        values, seconds = await run_block(session, url, bodies[name], stream, per_block,
                                                          concurrency, headers[name], first=block * per_block)
                        lat[name] += values
                        wall[name] += seconds
                        if name in calls_made:
                            calls_made[name] += len(values)
                base50, base99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
                added = {}
                for name in case_targets:
                    p50, p99 = pct(lat[name], 0.5), pct(lat[name], 0.99)
                    rps = len(lat[name]) / wall[name]
                    added[name] = (p50 - base50, rps)
                    print(f"{case:<24}{name:<{width}}{p50 * 1e3:9.2f}{p99 * 1e3:9.2f}{(p50 - base50) * 1e3:9.2f}"
                          f"{(p99 - base99) * 1e3:9.2f}{rps:9.1f}")
                floor_added, floor_rps = added["floor"]
                agl_added, agl_rps = added["agl-sidecar"]
                ratio = agl_added / floor_added if floor_added > 0 else float("nan")
                # The targets: at c=1 no more added than the floor's (1.2x on the slow path an
                # engine spelled otherwise takes), at c=64 at least 90% of its throughput.
                if concurrency == 1:
                    target = "target <= 1.2x" if spelling == "spaced" else "target <= 1.0x"
                else:
                    target = "target >= 90%"
                print(f"{'':<24}=> agl-sidecar added p50 / floor's {ratio:.2f}x; throughput / floor's "
                      f"{agl_rps / floor_rps:.0%} ({target})")
                if "floor-lean" in added:
                    lean_added, lean_rps = added["floor-lean"]
                    print(f"{'':<24}=> floor-lean (the floor on agl's engine client) added p50 / floor's "
                          f"{lean_added / floor_added if floor_added > 0 else float('nan'):.2f}x, throughput / "
                          f"floor's {lean_rps / floor_rps:.0%}; agl-sidecar / floor-lean: added p50 "
                          f"{agl_added / lean_added if lean_added > 0 else float('nan'):.2f}x, throughput {agl_rps / lean_rps:.0%}")
                declared_added, declared_rps = added["agl-declared"]
                print(f"{'':<24}=> declared structure: added p50 {(declared_added - agl_added) * 1e3:+.2f} ms, "
                      f"throughput {declared_rps / agl_rps:.0%} of agl-sidecar's")
                for peer in peers:
                    if peer.name not in added:
                        continue
                    peer_added, peer_rps = added[peer.name]
                    vs_floor = peer_added / floor_added if floor_added > 0 else float("nan")
                    vs_peer = agl_added / peer_added if peer_added > 0 else float("nan")
                    print(f"{'':<24}=> {peer.name} added p50 / floor's {vs_floor:.2f}x, throughput / floor's "
                          f"{peer_rps / floor_rps:.0%}; agl-sidecar vs {peer.name}: added p50 {vs_peer:.2f}x, "
                          f"throughput {agl_rps / peer_rps:.2f}x")
            busy_rss = rss_mb(sidecar.pid)
            per_call_ms = {}
            for name, p in measured:
                used = cpu_s(p.pid) - cpu_before[name]
                calls = calls_made[name] + (calls_made["agl-declared"] if name == "agl-sidecar" else 0)
                per_call_ms[name] = used / max(calls, 1) * 1e3
                print(f"CPU per call, whole run: {name} {per_call_ms[name]:.3f} ms")
            print(f"=> CPU per call / floor's: {per_call_ms['agl-sidecar'] / per_call_ms['floor']:.2f}x (target <= 1.2x)")
            if lean is not None:
                print(f"=> CPU per call / floor-lean's: {per_call_ms['agl-sidecar'] / per_call_ms['floor-lean']:.2f}x "
                      "(what the sidecar's own work costs over a pass-through on the same client)")
            plain_us, declared_us = declared_structure_cpu_us()
            print(f"reading a call's identity (attribution.resolve, in process): {plain_us:.2f} us plain, "
                  f"{declared_us:.2f} us with declared structure (+{declared_us - plain_us:.2f} us = "
                  f"{(declared_us - plain_us) / (per_call_ms['agl-sidecar'] * 1e3):.2%} of the sidecar's CPU per call)")
            for peer in peers:
                used = _peers.tree_cpu_s(peer.proc.pid) - cpu_before[peer.name]
                print(f"CPU per call, whole run: {peer.name} {used / max(calls_made[peer.name], 1) * 1e3:.3f} ms")
            async with session.get(f"http://127.0.0.1:{sidecar_port}/agl/v1/state") as r:
                counters = (await r.json())["counters"]
            print(f"RSS after the run: agl-sidecar {busy_rss:.0f} MB (idle {idle_rss:.0f} MB), floor {rss_mb(procs[1].pid):.0f} MB"
                  + "".join(f", {p.name} {_peers.tree_rss_mb(p.proc.pid):.0f} MB (idle {peer_idle_rss[p.name]:.0f} MB)"
                            for p in peers))
            for peer in peers:
                print(f"peer {peer.name}: {peer.version}")
            print(f"spans exported {counters['spans_exported']}, spooled {counters['spans_spooled']}, "
                  f"failed {counters['spans_failed']}, bytes exported {counters['bytes_exported']}")
    finally:
        for peer in peers:
            peer.stop()
        # The sidecars first, and wait for them: they flush their spans to the sink on the way out.
        stop_processes(procs[3:])
        stop_processes(procs[:3])
        shutil.rmtree(spool, ignore_errors=True)
        shutil.rmtree(peer_dir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=textwrap.dedent(__doc__ or ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls per case (finishes in about a minute)")
    parser.add_argument("--peers", action="store_true",
                        help="also measure the litellm proxy and Agent Lightning's gateway (installs them under /tmp "
                             "with scripts/setup_bench_peers.sh on first use)")
    parser.add_argument("--case", metavar="TEXT", action="append",
                        help="run only the cases whose name contains TEXT, e.g. --case '30k unary c=1' "
                             "(repeatable: the cases any of them names)")
    parser.add_argument("--blocks", type=int, metavar="N", help="interleaved blocks per case (default 8, 3 with --quick)")
    parser.add_argument("--lean-floor", action="store_true",
                        help="also run the floor with its upstream call made by agl-sidecar's own engine client "
                             "(floor-lean): the sidecar's own work against a pass-through on the same client")
    parser.add_argument("--spelling", choices=(*SPELLINGS, "both"), default="vllm",
                        help="how the fake engine spells its JSON: vLLM's compact bytes (default), with "
                             "spaces (as other servers write it), or a run of each")
    args = parser.parse_args()
    for text in args.case or ():
        if not any(text in case[0] for case in CASES):
            parser.error(f"--case {text!r} matches no case; the cases are: {', '.join(c[0] for c in CASES)}")
    if args.blocks is not None and args.blocks < 1:
        parser.error(f"--blocks must be at least 1, got {args.blocks}")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import uvloop

    for spelling in SPELLINGS if args.spelling == "both" else (args.spelling,):
        uvloop.run(main(args.quick, args.peers, args.case, args.blocks, spelling, args.lean_floor))
