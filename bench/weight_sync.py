"""Benchmark: weight sync into a running vLLM server (CPU build) vs restarting it, by model size.

    python bench/weight_sync.py [--quick] [--json out.json]

For each model size it starts one managed vLLM server (VLLMEngine) and measures, in the same run:
  - restart: the server's start until /health answers (what a sync without vLLM's APIs would cost);
  - one RL step's other parts on this machine: generation (16 concurrent completions of 32 tokens
    through vLLM) and a training step (forward, backward, AdamW on those sequences, transformers);
  - sync: VLLMEngine.update_weights with the state_dict just trained (safetensors written to
    /dev/shm, then pause, collective_rpc load, prefix-cache reset, version, resume), median of N;
    split into the write, the worker's load, and the HTTP control calls.
It prints sync time, its share of a step (sync / (generate + train + sync)) and restart / sync.
Needs .venv-vllm (bash scripts/setup_vllm_venv.sh). --quick runs the smallest size only, with
fewer repeats; it still pays one server start (30-140 s on 2 busy cores), so it takes 1-3 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agl_trainer.engines.base import WeightUpdate
from agl_trainer.engines.vllm import DEFAULT_VENV_PYTHON, VLLMConfig, VLLMEngine
from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model

SIZES = {
    "S": TinyModelSpec(hidden=128, heads=2, kv_heads=2, layers=2, intermediate=512),
    "M": TinyModelSpec(hidden=384, heads=6, kv_heads=2, layers=4, intermediate=1536),
    "L": TinyModelSpec(hidden=768, heads=12, kv_heads=4, layers=6, intermediate=3072),
}
BATCH, PROMPT_TOKENS, NEW_TOKENS = 16, 16, 32


@dataclass
class Result:
    size: str
    parameters: int
    megabytes: float
    restart_s: float
    generate_s: float
    train_s: float
    sync_s: float
    write_s: float
    worker_load_s: float
    control_s: float

    @property
    def step_share(self) -> float:
        return self.sync_s / (self.generate_s + self.train_s + self.sync_s)

    @property
    def restart_ratio(self) -> float:
        return self.restart_s / self.sync_s


def generate(url: str) -> tuple[float, list[list[int]]]:
    def one(i: int) -> list[int]:
        body = {"model": "bench", "prompt": [3 + (i * 7 + j) % 300 for j in range(PROMPT_TOKENS)],
                "max_tokens": NEW_TOKENS, "ignore_eos": True, "seed": i, "return_token_ids": True, "logprobs": 0}  # fmt: skip
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        return body["prompt"] + reply["choices"][0]["token_ids"]

    started = time.perf_counter()
    with ThreadPoolExecutor(BATCH) as pool:
        sequences = list(pool.map(one, range(BATCH)))
    return time.perf_counter() - started, sequences


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sequences: list[list[int]]) -> float:
    started = time.perf_counter()
    batch = torch.tensor(sequences)
    labels = batch.clone()
    labels[:, :PROMPT_TOKENS] = -100
    loss = model(batch, labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return time.perf_counter() - started


def measure(
    size: str, spec: TinyModelSpec, python: str, repeats: int, workdir: Path, progress: Progress
) -> Result:
    from transformers import AutoModelForCausalLM

    task = progress.add_task(f"size {size}: building model", total=4 + repeats)
    model_dir = build_bpe_model(workdir / f"model-{size}", spec=spec)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    progress.update(
        task, advance=1, description=f"size {size}: starting vLLM ({parameters / 1e6:.1f}M params)"
    )
    engine = VLLMEngine(
        VLLMConfig(
            model=str(model_dir),
            python=python,
            served_model_name="bench",
            max_model_len=256,
            log_dir=str(workdir / f"logs-{size}"),
            watchdog_interval_s=0,
        )
    )
    started = time.perf_counter()
    engine.start()
    restart_s = time.perf_counter() - started
    try:
        progress.update(task, advance=1, description=f"size {size}: warming up")
        generate(engine.urls[0])  # the first requests compile and allocate
        progress.update(task, advance=1, description=f"size {size}: generate + train")
        generate_s, sequences = generate(engine.urls[0])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()
        train_step(model, optimizer, sequences)  # the first step allocates optimizer state
        train_s = train_step(model, optimizer, sequences)
        progress.update(task, advance=1, description=f"size {size}: weight sync")
        reports = []
        for version in range(1, repeats + 1):
            engine.update_weights(WeightUpdate(version=version, state_dict=model.state_dict()))
            reports.append(engine.last_sync)
            progress.update(task, advance=1)
    finally:
        engine.stop()
    median = statistics.median
    write_s = median(r.write_seconds for r in reports)
    load_s = median(max(r.load_seconds) for r in reports)
    server_s = median(max(r.server_seconds) for r in reports)
    return Result(
        size=size, parameters=parameters, megabytes=megabytes, restart_s=restart_s, generate_s=generate_s,
        train_s=train_s, sync_s=median(r.seconds for r in reports), write_s=write_s, worker_load_s=load_s,
        control_s=max(server_s - load_s, 0.0),
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smallest size only, 3 syncs")
    parser.add_argument("--sizes", default=None, help=f"comma-separated subset of {','.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=None, help="syncs per size (default 10, quick 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--python", default=str(DEFAULT_VENV_PYTHON), help="interpreter with vllm")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 160))
    if not Path(args.python).exists():
        console.print(f"[red]{args.python} is missing: run `bash scripts/setup_vllm_venv.sh` first[/red]")
        return 2
    sizes = args.sizes.split(",") if args.sizes else (["S"] if args.quick else list(SIZES))
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        console.print(f"[red]unknown size(s) {unknown}; choose from {list(SIZES)}[/red]")
        return 2
    repeats = args.repeats or (3 if args.quick else 10)
    torch.manual_seed(0)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="agl-bench-sync-") as tmp, Progress(console=console) as progress:
        for size in sizes:
            results.append(measure(size, SIZES[size], args.python, repeats, Path(tmp), progress))

    table = Table(
        title=f"weight sync into vLLM (CPU build), median of {repeats}; step = {BATCH} x {NEW_TOKENS} tokens"
    )
    for column in ("size", "params", "MB", "sync ms", "write ms", "worker load ms", "control ms",
                   "generate ms", "train ms", "sync share of step", "restart s", "restart / sync"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.size, f"{r.parameters / 1e6:.2f}M", f"{r.megabytes:.1f}", f"{r.sync_s * 1e3:.0f}", f"{r.write_s * 1e3:.0f}",
            f"{r.worker_load_s * 1e3:.0f}", f"{r.control_s * 1e3:.0f}", f"{r.generate_s * 1e3:.0f}",
            f"{r.train_s * 1e3:.0f}", f"{r.step_share:.1%}", f"{r.restart_s:.1f}", f"{r.restart_ratio:.0f}x",
        )  # fmt: skip
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"step_share": r.step_share, "restart_ratio": r.restart_ratio}
                                         for r in results], indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
