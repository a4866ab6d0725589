"""Benchmark: weight sync into a running vLLM server (CPU build) vs restarting it, by model size.

    python bench/weight_sync.py [--quick] [--json out.json]

For each model size it starts one managed vLLM server (VLLMEngine) and measures, in the same run:
  - restart: the server's start until /health answers (what a sync without vLLM's APIs would cost);
  - one RL step's other parts on this machine: generation (16 concurrent completions of 32 tokens
    through vLLM) and a training step (forward, backward, AdamW on those sequences, transformers),
    median of 3 each;
  - sync: VLLMEngine.update_weights with the state_dict just trained (safetensors written to
    /dev/shm, then pause, collective_rpc load, prefix-cache reset, version, resume), median of N;
    split into the write, the worker's load, and the HTTP control calls.
It prints sync time, its share of a step (sync / (generate + train + sync)) and restart / sync.

LoRA (--lora-rank R, default 8; 0 measures full syncs on a server without LoRA, as before): the server
is started with engine.vllm.lora_rank R (the base served as bench-base, the adapter as bench) and the
same run measures, interleaved, both kinds of sync into it:
  - full: the whole state_dict, as above; on a LoRA server it also loads the engine's "empty" adapter in
    the same pause (full weights are the new base; engines/vllm/lora.py), a few ms in the worker's load;
    "full MB" is the engine's count, the tied output head included;
  - adapter: VLLMEngine.update_weights with WeightUpdate.adapter, peft's A and B of every linear layer of
    a block (backend.lora's default targets) after a LoRA training step over the same sequences.
Each kind's share of a step uses its own step: full = generation through the base + a full training step;
adapter = generation through the adapter (vLLM's LoRA kernels) + a LoRA training step (peft, AdamW on
the adapter). Printed: bytes and time per sync, shares, and full / adapter for bytes and time.
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

from agl_trainer.backends import lora
from agl_trainer.backends.torch_config import LoraConfig
from agl_trainer.engines.vllm.config import DEFAULT_VENV_PYTHON
from agl_trainer.engines.vllm.config import VLLMConfig, VLLMOptions
from agl_trainer.engines.vllm.engine import SyncReport, VLLMEngine
from agl_trainer.engines.vllm.lora import base_model_name
from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model
from agl_trainer.weights.update import WeightUpdate

SIZES = {
    "S": TinyModelSpec(hidden=128, heads=2, kv_heads=2, layers=2, intermediate=512),
    "M": TinyModelSpec(hidden=384, heads=6, kv_heads=2, layers=4, intermediate=1536),
    "L": TinyModelSpec(hidden=768, heads=12, kv_heads=4, layers=6, intermediate=3072),
}
BATCH, PROMPT_TOKENS, NEW_TOKENS = 16, 16, 32
STEP_REPEATS = 3  # generations and training steps per kind, median: one alone moves with the machine's load


@dataclass
class AdapterResult:
    """The LoRA side of one size: adapter-only syncs, their step (generation through the adapter, a LoRA
    training step), and the full syncs' bytes for the ratio."""

    rank: int
    megabytes: float  # the adapter's tensors, as the sync reports them
    sync_s: float
    write_s: float
    worker_load_s: float
    generate_s: float
    train_s: float
    full_megabytes: float
    full_sync_s: float

    @property
    def step_share(self) -> float:
        return self.sync_s / (self.generate_s + self.train_s + self.sync_s)


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
    adapter: AdapterResult | None = None

    @property
    def step_share(self) -> float:
        return self.sync_s / (self.generate_s + self.train_s + self.sync_s)

    @property
    def restart_ratio(self) -> float:
        return self.restart_s / self.sync_s


def generate(url: str, model: str = "bench") -> tuple[float, list[list[int]]]:
    def one(i: int) -> list[int]:
        body = {"model": model, "prompt": [3 + (i * 7 + j) % 300 for j in range(PROMPT_TOKENS)],
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


def _medians(reports: list[SyncReport]) -> tuple[float, float, float, float]:
    """seconds, write, the slowest worker's load and the HTTP control calls around it: medians."""
    median = statistics.median
    load_s = median(max(r.load_seconds) for r in reports)
    server_s = median(max(r.server_seconds) for r in reports)
    seconds, write_s = median(r.seconds for r in reports), median(r.write_seconds for r in reports)
    return seconds, write_s, load_s, max(server_s - load_s, 0.0)


def measure(
    size: str, spec: TinyModelSpec, python: str, repeats: int, workdir: Path, progress: Progress, rank: int
) -> Result:
    from transformers import AutoModelForCausalLM

    task = progress.add_task(f"size {size}: building model", total=4 + repeats * (2 if rank else 1))
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
            options=VLLMOptions(
                python=python,
                served_model_name="bench",
                max_model_len=256,
                log_dir=str(workdir / f"logs-{size}"),
                watchdog_interval_s=0,
                lora_rank=rank,
            ),
        )
    )
    started = time.perf_counter()
    engine.start()
    restart_s = time.perf_counter() - started
    try:
        url, base = engine.urls[0], base_model_name("bench") if rank else "bench"
        progress.update(task, advance=1, description=f"size {size}: warming up")
        generate(url, base)  # the first requests compile and allocate
        progress.update(task, advance=1, description=f"size {size}: generate + train")
        generate_s, sequences = generate(url, base)
        more = [generate(url, base)[0] for _ in range(STEP_REPEATS - 1)]
        generate_s = statistics.median([generate_s, *more])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model.train()
        train_step(model, optimizer, sequences)  # the first step allocates optimizer state
        train_s = statistics.median(train_step(model, optimizer, sequences) for _ in range(STEP_REPEATS))
        if rank:  # the LoRA run's step: generation through the adapter, a step of the adapter alone
            generate(url)  # the adapter's first requests warm vLLM's LoRA kernels
            adapter_generate_s = statistics.median(generate(url)[0] for _ in range(STEP_REPEATS))
            # the LoRA run's trainer: peft over a second copy of the base (the torch backend's targets)
            base_copy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            tuned = lora.wrap(base_copy, LoraConfig(rank=rank))
            adapter_optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=1e-4)
            tuned.train()
            train_step(tuned, adapter_optimizer, sequences)  # B is no longer zero: a real adapter to sync
            adapter_train_s = statistics.median(
                train_step(tuned, adapter_optimizer, sequences) for _ in range(STEP_REPEATS)
            )
            adapter = lora.adapter_state(tuned)
        progress.update(task, advance=1, description=f"size {size}: weight sync")
        reports, adapter_reports = [], []
        for version in range(1, repeats + 1):  # full and adapter syncs alternate: the same load on both
            engine.update_weights(WeightUpdate(version=2 * version - 1, state_dict=model.state_dict()))
            reports.append(engine.last_sync)
            progress.update(task, advance=1)
            if rank:
                engine.update_weights(WeightUpdate(version=2 * version, adapter=adapter))
                adapter_reports.append(engine.last_sync)
                progress.update(task, advance=1)
    finally:
        engine.stop()
    sync_s, write_s, load_s, control_s = _medians(reports)
    result = Result(
        size=size, parameters=parameters, megabytes=megabytes, restart_s=restart_s, generate_s=generate_s,
        train_s=train_s, sync_s=sync_s, write_s=write_s, worker_load_s=load_s, control_s=control_s,
    )  # fmt: skip
    if rank:
        a_sync_s, a_write_s, a_load_s, _ = _medians(adapter_reports)
        result.adapter = AdapterResult(
            rank=rank, megabytes=adapter_reports[0].nbytes / 1e6, sync_s=a_sync_s, write_s=a_write_s,
            worker_load_s=a_load_s, generate_s=adapter_generate_s, train_s=adapter_train_s,
            full_megabytes=reports[0].nbytes / 1e6, full_sync_s=sync_s,
        )  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smallest size only, 3 syncs")
    parser.add_argument("--sizes", default=None, help=f"comma-separated subset of {','.join(SIZES)}")
    parser.add_argument("--repeats", type=int, default=None, help="syncs per size (default 10, quick 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--python", default=str(DEFAULT_VENV_PYTHON), help="interpreter with vllm")
    parser.add_argument("--lora-rank", type=int, default=8,
                        help="serve with LoRA: adapter syncs beside full ones (0: full only)")  # fmt: skip
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
            result = measure(size, SIZES[size], args.python, repeats, Path(tmp), progress, args.lora_rank)
            results.append(result)

    server = f"a server with lora_rank {args.lora_rank}" if args.lora_rank else "a server without LoRA"
    table = Table(
        title=f"full weight sync into vLLM (CPU build, {server}), median of {repeats}; "
        f"step = {BATCH} x {NEW_TOKENS} tokens"
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
    if args.lora_rank:
        lora_table = Table(
            title=f"adapter-only sync (rank {args.lora_rank}, q/k/v/o/gate/up/down) vs full sync, same "
            f"server, median of {repeats} each, interleaved; step: generation through the adapter + LoRA step"
        )
        for column in ("size", "full MB", "adapter MB", "full / adapter MB", "full sync ms",
                       "adapter sync ms", "full / adapter time", "adapter write ms", "adapter worker load ms",
                       "adapter generate ms", "LoRA train ms", "full share", "adapter share"):  # fmt: skip
            lora_table.add_column(column, justify="right")
        for r in results:
            a = r.adapter
            assert a is not None
            lora_table.add_row(
                r.size, f"{a.full_megabytes:.1f}", f"{a.megabytes:.3f}",
                f"{a.full_megabytes / a.megabytes:.0f}x",
                f"{a.full_sync_s * 1e3:.0f}", f"{a.sync_s * 1e3:.0f}", f"{a.full_sync_s / a.sync_s:.1f}x",
                f"{a.write_s * 1e3:.1f}", f"{a.worker_load_s * 1e3:.0f}", f"{a.generate_s * 1e3:.0f}",
                f"{a.train_s * 1e3:.0f}", f"{r.step_share:.1%}", f"{a.step_share:.1%}",
            )  # fmt: skip
        console.print(lora_table)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"step_share": r.step_share, "restart_ratio": r.restart_ratio}
                                         | ({"adapter_step_share": r.adapter.step_share} if r.adapter else {})
                                         for r in results], indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
