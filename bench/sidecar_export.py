"""What exporting spans costs a call: agl-sidecar with no OTLP endpoint (the reference) against the
same sidecar exporting with its defaults, without gzip, with small export requests and with gzip
on every request.

    python bench/sidecar_export.py [--chars N] [--unique] [--blocks N] [--per-block N]

Over loopback: the bench's fake vLLM (one token a character, so a 30k-character prompt is 30k token
IDs and about 180 KB of span) and OTLP sink (bench/sidecar_overhead.py), and five sidecars on it,
called in turn in interleaved blocks at concurrency 1. Prints each one's p50 and p99 latency, its CPU
per call (read from /proc around its own blocks, plus a short settle for the span it exports after
the answer) and the ratios against the sidecar that exports nothing. On a 2-core machine the sink
shares the cores with the client, the engine and the sidecars, so a p99 here is partly the sink's.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import sidecar_overhead as overhead  # bench/sidecar_overhead.py: the fake vLLM and the sink
from _load import JSON, free_port, pct, run_block, stop_processes, wait_up

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# name -> sidecar settings (a YAML file's keys); None: no OTLP endpoint at all.
VARIANTS: dict[str, dict[str, object] | None] = {
    "no endpoint": None,
    "defaults": {},  # on loopback: gzip only requests mostly made of prompts sent before
    "no gzip": {"otlp_compression": "none"},
    "256 KiB requests": {"export_batch_bytes": 256 * 1024},
    "gzip": {"otlp_compression": "gzip"},
}


async def main(chars: int, unique: bool, blocks: int, per_block: int) -> None:
    import aiohttp
    import msgspec

    scratch = Path(tempfile.mkdtemp(prefix="agl-bench-export-"))
    fake_port, sink_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{fake_port}"
    procs = [
        subprocess.Popen([PY, "-c", overhead.FAKE.format(root=str(ROOT), port=fake_port, spaced=False)]),
        subprocess.Popen([PY, "-c", overhead.SINK.format(port=sink_port)]),
    ]
    sidecars: dict[str, tuple[str, subprocess.Popen]] = {}
    try:
        for index, (name, settings) in enumerate(VARIANTS.items()):
            port = free_port()
            command = [PY, "-m", "agl_sidecar.cli", "--upstream", upstream, "--listen", f"127.0.0.1:{port}",
                       "--spool-dir", str(scratch / f"spool-{index}")]
            if settings is not None:
                command += ["--otlp-endpoint", f"http://127.0.0.1:{sink_port}"]
                if settings:
                    config = scratch / f"sidecar-{index}.yaml"
                    config.write_text("".join(f"{key}: {value}\n" for key, value in settings.items()))
                    command += ["--config", str(config)]
            proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(proc)
            sidecars[name] = (f"http://127.0.0.1:{port}", proc)
        texts = [overhead.unique_text(chars, i) for i in range(blocks * per_block * len(VARIANTS) + 2)] if unique else [
            ("lorem ipsum " * (chars // 12 + 1))[:chars]]
        bodies = [msgspec.json.encode({"model": "tiny", "messages": [{"role": "user", "content": text}],
                                       "max_tokens": 32}) for text in texts]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_up(upstream + "/health", session)
            await wait_up(f"http://127.0.0.1:{sink_port}/v1/traces", session)
            for url, _ in sidecars.values():
                await wait_up(url + "/healthz", session)
                await run_block(session, url + "/v1/chat/completions", bodies, False, 2, 1, JSON, first=len(bodies) - 2)
            latencies: dict[str, list[float]] = {name: [] for name in sidecars}
            cpu: dict[str, float] = {name: 0.0 for name in sidecars}
            turn = 0
            for _ in range(blocks):
                for name, (url, proc) in sidecars.items():
                    before = overhead.cpu_s(proc.pid)
                    values, _ = await run_block(session, url + "/v1/chat/completions", bodies, False, per_block, 1,
                                                JSON, first=turn % len(bodies))
                    turn += per_block
                    await asyncio.sleep(0.3)  # the last call's span is built and exported after its answer
                    cpu[name] += overhead.cpu_s(proc.pid) - before
                    latencies[name] += values
        reference = "no endpoint"
        ref_cpu = cpu[reference] / len(latencies[reference])
        ref_p99 = pct(latencies[reference], 0.99)
        print(f"{chars}-character prompts{' that never repeat' if unique else ''}, c=1, {blocks} blocks of {per_block}")
        print(f"{'sidecar':<18}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/call':>13}{'CPU / ref':>11}{'p99 / ref':>11}")
        for name, values in latencies.items():
            per_call = cpu[name] / len(values)
            p99 = pct(values, 0.99)
            print(f"{name:<18}{pct(values, 0.5) * 1e3:9.2f}{p99 * 1e3:9.2f}{per_call * 1e3:13.3f}"
                  f"{per_call / ref_cpu:10.2f}x{p99 / ref_p99:10.2f}x")
    finally:
        stop_processes(procs)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=30000, help="prompt characters (default 30000)")
    parser.add_argument("--unique", action="store_true", help="a prompt per call that never repeats")
    parser.add_argument("--blocks", type=int, default=12, help="interleaved blocks per sidecar (default 12)")
    parser.add_argument("--per-block", type=int, default=48, help="calls per block (default 48)")
    args = parser.parse_args()
    for flag in ("chars", "blocks", "per_block"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    import uvloop

    uvloop.run(main(args.chars, args.unique, args.blocks, args.per_block))
