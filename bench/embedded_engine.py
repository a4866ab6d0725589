"""Benchmark: the embedded engine serving the demo's episodes, batched vs one at a time vs in-process.

    python bench/embedded_engine.py [--quick]

A batch of demo episodes (16 tasks x 8 episodes, two calls each, as the demo runs them) is played
three ways, on the same warm-started demo model, in the same run:
  in-process   batched sampling in this process (examples/demo/episodes.py): no HTTP at all
  concurrent   every episode at once through the engine's HTTP API (the harness, AsyncOpenAI)
  sequential   the same episodes one after another through the engine (no batching possible)
The harness runs in a separate client process, as runners run it, so the engine's process is not
slowed by the client's own Python work.
It prints episodes per second for each and the ratios: concurrent vs sequential is what
continuous batching buys; concurrent vs in-process is what the server (HTTP, JSON, the openai SDK)
costs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.table import Table


async def _concurrent(tasks: list[dict], url: str) -> float:
    from examples.demo.harness import run_episode_async

    started = time.perf_counter()
    await asyncio.gather(*(run_episode_async(t, url) for t in tasks))
    return time.perf_counter() - started


async def _sequential(tasks: list[dict], url: str) -> float:
    from examples.demo.harness import run_episode_async

    started = time.perf_counter()
    for task in tasks:
        await run_episode_async(task, url)
    return time.perf_counter() - started


def _client(url: str, mode: str, tasks_json: str, repeats: int) -> None:
    """The client process: play the episodes `repeats` times after a warm-up, print the times."""
    import json

    tasks = json.loads(tasks_json)
    play = _concurrent if mode == "concurrent" else _sequential
    asyncio.run(_concurrent(tasks[:8], url))
    print(json.dumps([asyncio.run(play(tasks, url)) for _ in range(repeats)]))


def _in_client_process(url: str, mode: str, tasks: list[dict], repeats: int) -> list[float]:
    import json
    import subprocess

    command = [sys.executable, __file__, "--client", url, "--mode", mode, "--repeats", str(repeats)]
    done = subprocess.run(
        command, input=json.dumps(tasks), capture_output=True, check=False, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"client process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and episodes (under a minute)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        _client(args.client, args.mode, sys.stdin.read(), args.repeats)
        return 0
    repeats = 2 if args.quick else 5
    tasks_per_batch, episodes_per_task = (8, 8) if args.quick else (16, 8)

    import torch
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.demo.episodes import DemoTokens, run_episodes
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.task import make_tasks

    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="agl-bench-engine-"))
    prepared = prepare_demo_model(workdir, seed=0, progress=False)
    tasks = [t for t in make_tasks(tasks_per_batch, seed=1) for _ in range(episodes_per_task)]
    model = AutoModelForCausalLM.from_pretrained(prepared.path, dtype=torch.float32)
    tokens = DemoTokens(AutoTokenizer.from_pretrained(prepared.path))
    results: dict[str, list[float]] = {"in-process": [], "concurrent": [], "sequential": []}
    with EmbeddedEngine(EmbeddedEngineConfig(model_path=prepared.path, served_model_name="tiny")) as engine:
        url = engine.urls[0] + "/v1"
        run_episodes(model, tokens, tasks[:8])  # warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            run_episodes(model, tokens, tasks)
            results["in-process"].append(time.perf_counter() - started)
        steps, busy = engine._scheduler.steps, engine._scheduler.busy_s
        results["concurrent"] = _in_client_process(url, "concurrent", tasks, repeats)
        steps, busy = engine._scheduler.steps - steps, engine._scheduler.busy_s - busy
        sequential_tasks = tasks[: max(16, len(tasks) // 4)]  # slow: a quarter, scaled up
        scale = len(tasks) / len(sequential_tasks)
        results["sequential"] = [
            t * scale for t in _in_client_process(url, "sequential", sequential_tasks, 1)
        ]

    best = {name: min(times) for name, times in results.items()}
    table = Table(title=f"{len(tasks)} demo episodes (2 calls each), best of {repeats}")
    table.add_column("mode")
    table.add_column("seconds", justify="right")
    table.add_column("episodes/s", justify="right")
    for name, seconds in best.items():
        table.add_row(name, f"{seconds:.3f}", f"{len(tasks) / seconds:.0f}")
    console.print(table)
    console.print(
        f"batching speed-up (sequential / concurrent): {best['sequential'] / best['concurrent']:.1f}x"
    )
    console.print(f"server cost (concurrent / in-process): {best['concurrent'] / best['in-process']:.1f}x")
    console.print(
        f"engine, concurrent runs: {steps / (repeats + 1):.0f} batching steps and {busy / (repeats + 1):.3f} s "
        "in forward passes and sampling per batch of episodes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
