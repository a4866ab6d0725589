"""One sidecar change measured: the floor, agl-sidecar at a git revision and this checkout's, side by side.

    python bench/sidecar_ab.py [--before REV] [--case '2k unary c=1']... [--blocks N] [--per-block N]
        [--quick]

`bench/sidecar_overhead.py` compares this checkout's sidecar with the floor (a minimal aiohttp proxy);
a change that moves the sidecar's CPU by a few percent drowns there in what the machine does between
two runs. Here the floor, the sidecar as it was at git revision REV (default HEAD: what the working
tree changes) and the working tree's run on one fake vLLM, in interleaved blocks, and each one's CPU
per call is read from /proc around its own blocks. Prints CPU per call and added p50 over direct for
each, and before / floor, after / floor. REV's sidecar is `git archive REV sidecar/agl_sidecar`, with
this checkout's built C extension copied in where REV has its source (so both run compiled).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import sidecar_overhead as overhead  # bench/sidecar_overhead.py: the fake vLLM, floor and sink programs
from _load import JSON, free_port, pct, run_block, wait_up

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CASES = [name for name, *_ in overhead.CASES]


def sidecar_at(revision: str, into: Path) -> Path:
    """The sidecar package as it was at `revision`, under `into`; returns the directory for PYTHONPATH."""
    archive = subprocess.run(
        ["git", "archive", revision, "sidecar/agl_sidecar"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / "sidecar" / "agl_sidecar"
    if (package / "_token_elements.c").is_file():
        for built in (ROOT / "sidecar" / "agl_sidecar").glob("_token_elements*.so"):
            shutil.copy2(built, package / built.name)
    return into / "sidecar"


async def measure(case: str, before_path: Path, blocks: int, per_block: int) -> None:
    import aiohttp
    import msgspec

    _, chars, stream, unique, concurrency = next(c for c in overhead.CASES if c[0] == case)
    fake, floor, sink = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{fake}"
    spool = tempfile.mkdtemp(prefix="agl-bench-ab-")
    procs = [
        subprocess.Popen([PY, "-c", overhead.FAKE.format(root=str(ROOT), port=fake, spaced=False)]),
        subprocess.Popen([PY, "-c", overhead.FLOOR.format(upstream=upstream, port=floor)]),
        subprocess.Popen([PY, "-c", overhead.SINK.format(port=sink)]),
    ]
    targets = {"floor": (floor, procs[1])}
    for name, path in (("before", before_path), ("after", ROOT / "sidecar")):
        port = free_port()
        proc = subprocess.Popen(
            [PY, "-m", "agl_sidecar.cli", "--upstream", upstream, "--listen", f"127.0.0.1:{port}",
             "--otlp-endpoint", f"http://127.0.0.1:{sink}", "--spool-dir", spool],
            stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": str(path)},
        )  # fmt: skip
        procs.append(proc)
        targets[name] = (port, proc)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_up(upstream + "/health", session)
            await wait_up(f"http://127.0.0.1:{floor}/v1/chat/completions", session)
            for name in ("before", "after"):
                await wait_up(f"http://127.0.0.1:{targets[name][0]}/healthz", session)
            count = blocks * per_block + 2
            texts = [overhead.unique_text(chars, i) for i in range(count)] if unique else [
                ("lorem ipsum " * (chars // 12 + 1))[:chars]]
            plain = [{"model": "tiny", "messages": [{"role": "user", "content": t}], "max_tokens": 32,
                      "stream": stream} for t in texts]  # fmt: skip
            bodies = [msgspec.json.encode(b) for b in plain]
            asks = {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}  # direct: it asks itself
            direct = [msgspec.json.encode({**b, **asks}) for b in plain]
            urls = {name: f"http://127.0.0.1:{port}/v1/chat/completions" 
                    for name, (port, _) in targets.items()}
            for url in urls.values():  # warm-up, on prompts the timed blocks do not send
                await run_block(session, url, bodies, stream, 2, 1, JSON, first=count - 2)
            cpu = dict.fromkeys(targets, 0.0)
            latencies: dict[str, list[float]] = {name: [] for name in ["direct", *targets]}
            for block in range(blocks):
                first = block * per_block
                values, _ = await run_block(session, upstream + "/v1/chat/completions", direct, stream,
                                            per_block, concurrency, JSON, first=first)  # fmt: skip
                latencies["direct"] += values
                for name, (_, proc) in targets.items():
                    start = overhead.cpu_s(proc.pid)
                    values, _ = await run_block(session, urls[name], bodies, stream, per_block, concurrency,
                                                JSON, first=first)  # fmt: skip
                    await asyncio.sleep(0.05)  # let its span work for these calls land in its count
                    cpu[name] += overhead.cpu_s(proc.pid) - start
                    latencies[name] += values
        calls = blocks * per_block
        base = pct(latencies["direct"], 0.5)
        per_call = {name: cpu[name] / calls for name in targets}
        parts = [
            f"{name} {per_call[name] * 1e3:.3f} ms CPU, "
            f"+{(pct(latencies[name], 0.5) - base) * 1e3:.2f} ms p50"
            for name in targets
        ]
        print(f"{case:<24}" + " | ".join(parts))
        print(f"{'':<24}=> CPU per call / floor's: before {per_call['before'] / per_call['floor']:.2f}x, "
              f"after {per_call['after'] / per_call['floor']:.2f}x", flush=True)  # fmt: skip
    finally:
        for proc in reversed(procs):  # the sidecars first: they flush their spans to the sink
            proc.terminate()
            proc.wait()
        shutil.rmtree(spool, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD", help="git revision of the sidecar to compare with (HEAD)")
    parser.add_argument("--case", action="append", choices=CASES, help="a case to run (repeatable; default "
                        "2k unary c=1, 2k stream c=1)")  # fmt: skip
    parser.add_argument("--blocks", type=int, help="interleaved blocks per target (default 20, --quick 3)")
    parser.add_argument("--per-block", type=int, help="calls per block (default 200; c=64 cases x3)")
    parser.add_argument("--quick", action="store_true", help="a short run, to check the bench works")
    args = parser.parse_args()
    cases = args.case or ["2k unary c=1", "2k stream c=1"]
    with tempfile.TemporaryDirectory(prefix="agl-bench-before-") as scratch:
        before = sidecar_at(args.before, Path(scratch))
        print(f"before: sidecar/ at {args.before}; after: this checkout's sidecar/")
        for case in cases:
            per_block = args.per_block or (20 if args.quick else 200)
            if case.endswith("c=64"):
                per_block *= 3
            if " unique " in case or case.startswith("30k"):
                per_block = max(per_block // 5, 8)
            blocks = args.blocks or (3 if args.quick else 20)
            asyncio.run(measure(case, before, blocks, per_block))


if __name__ == "__main__":
    main()
