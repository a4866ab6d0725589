"""The weights' export for the engine (`state_dict_for_engine(bfloat16)`, where every weight sync
starts): verl's FSDP2 workers against the torch backend, both holding the same model at once, their
exports interleaved round by round (the same machine load for both), medians and the ratio.

verl's export gathers each full tensor from the shards (a collective on every rank), casts it and
copies it to the host on rank 0, and hands it through Ray to the driver; the torch backend casts and
copies its own tensors. The model is a random Qwen2 built offline (`--model small`: 41 M parameters;
`0.5b`: Qwen2-0.5B's shape, 494 M, about 2 GB in float32 per backend). glibc's mmap threshold is
pinned in the driver (bench/train_step.py pin_malloc), so every export allocates as the first did.

    python bench/weight_export.py                      # small model, world size 1, 7 rounds
    python bench/weight_export.py --workers 2          # two verl ranks (gloo on the CPU)
    python bench/weight_export.py --device cuda --model 0.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from gpu_step import MODELS, build_model, make_backend  # noqa: E402 - bench/ is not a package
from train_step import pin_malloc  # noqa: E402


def timed_export(backend: object, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    weights = backend.state_dict_for_engine(torch.bfloat16)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - started
    del weights
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--workers", type=int, default=1, help="verl ranks")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("weight_export: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    pin_malloc()  # freed tensors leave the process: each export allocates as the first one did
    with tempfile.TemporaryDirectory(prefix="agl-weight-export-") as tmp:
        model_dir = build_model(Path(tmp) / "model", MODELS[args.model])
        torch_backend = make_backend("torch", model_dir, args.device, 1, 16384)
        verl_backend = make_backend("verl", model_dir, args.device, args.workers, 16384)
        try:
            exported = verl_backend.state_dict_for_engine(torch.bfloat16)  # warm-up: Ray paths, allocations
            want = torch_backend.state_dict_for_engine(torch.bfloat16)
            assert set(exported) == set(want) and all(torch.equal(exported[n], want[n]) for n in want)
            nbytes = sum(t.numel() * t.element_size() for t in want.values())
            del exported, want
            times: dict[str, list[float]] = {"torch": [], "verl": []}
            for _ in range(args.rounds):
                times["torch"].append(timed_export(torch_backend, args.device))
                times["verl"].append(timed_export(verl_backend, args.device))
        finally:
            verl_backend.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"weights export (bf16, {nbytes / 2**20:.0f} MiB, Qwen2 {args.model}, {args.device}, verl ranks "
        f"{args.workers}), median of {args.rounds} interleaved rounds:"
    )
    for name in ("torch", "verl"):
        spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}"
        print(f"  {name:<6} {medians[name]:.3f} s  ({spread} s; {nbytes / medians[name] / 2**30:.2f} GiB/s)")
    print(f"verl / torch: {medians['verl'] / medians['torch']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"nbytes": nbytes, "times": times, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
