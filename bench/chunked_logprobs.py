"""The output head's log-probs and entropy, whole vs in chunks of positions (backends/chunked_logprobs.py).

One forward and backward of what a training micro-batch does at its scored positions: hidden
states [K, H] through the head (V x H; Qwen2-0.5B's 896 x 151,936 by default) to log p(token) and
the entropy, a loss over both, backward to the hidden states and the head. The reference applies
`token_logprobs` / `token_entropy` to the whole [K, V] logits (what both backends did before);
`chunked` is `token_outputs` with its default chunk (441 positions of a 151,936 vocabulary). Both run
in this process, interleaved, and must agree bit for bit (checked each round on the CPU).

Per variant: the median seconds of a forward + backward, and the peak memory above the inputs:
on the CPU the rise of the resident set (VmHWM reset through /proc/self/clear_refs, glibc's mmap
threshold pinned so freed tensors leave it), on CUDA torch.cuda.max_memory_allocated. Ratios are
chunked / whole.

    python bench/chunked_logprobs.py                       # CPU, float32 logits, K=1024
    python bench/chunked_logprobs.py --dtype bfloat16      # the head under bfloat16 autocast, as on a GPU
    python bench/chunked_logprobs.py --device cuda --positions 8192 --dtype bfloat16
    python bench/chunked_logprobs.py --quick               # K=512, vocabulary 32,768, chunks of 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from train_step import pin_malloc, step_peak_mb  # noqa: E402 - bench/ is not a package

from agl_trainer.algorithms import token_entropy, token_logprobs
from agl_trainer.backends.chunked_logprobs import chunk_positions, token_outputs


def make_step(
    device: torch.device, dtype: torch.dtype, chunked: bool, inputs: dict[str, torch.Tensor], chunk: int | None
) -> Any:
    def step(_: object = None) -> tuple[torch.Tensor, ...]:
        hidden = inputs["hidden"].detach().requires_grad_()
        weight = inputs["weight"]
        weight.grad = None
        logits = F.linear(hidden.to(dtype), weight.to(dtype))
        labels = inputs["labels"]
        if chunked:
            log_prob, entropy = token_outputs(logits, labels, entropy_grad=True, chunk_tokens=chunk)
        else:
            log_prob, entropy = token_logprobs(logits, labels), token_entropy(logits)
        assert entropy is not None
        loss = (inputs["a"] * log_prob).sum() + 0.01 * entropy.sum()
        del logits
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return log_prob.detach(), entropy.detach(), hidden.grad, weight.grad.clone()

    return step


def measure(device: torch.device, step: Any, inputs: object) -> tuple[float, float, tuple[torch.Tensor, ...]]:
    """(seconds, peak MB above the resident inputs, outputs) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - started
        return seconds, (torch.cuda.max_memory_allocated() - base) / 2**20, out
    measured = step_peak_mb(lambda _: step())
    started = time.perf_counter()
    out = measured(inputs)
    seconds = time.perf_counter() - started
    return seconds, measured.peaks[-1], out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    pin_malloc()
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden": torch.randn(args.positions, args.hidden, generator=generator).to(device),
        "weight": (0.02 * torch.randn(args.vocab, args.hidden, generator=generator)).to(device).requires_grad_(),
        "labels": torch.randint(0, args.vocab, (args.positions,), generator=generator).to(device),
        "a": torch.randn(args.positions, generator=generator).to(device),
    }
    steps = {name: make_step(device, dtype, name == "chunked", inputs, args.chunk) for name in ("whole", "chunked")}
    steps["whole"]()  # warm-up: allocator, kernels
    steps["chunked"]()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    peaks: dict[str, list[float]] = {name: [] for name in steps}
    exact = True
    for _ in range(args.rounds):
        outputs = {}
        for name, step in steps.items():  # interleaved, round by round
            s, peak, outputs[name] = measure(device, step, None)
            seconds[name].append(s)
            peaks[name].append(peak)
        exact = exact and all(torch.equal(a, b) for a, b in zip(outputs["whole"], outputs["chunked"], strict=True))
    result = {
        "device": args.device, "dtype": args.dtype, "positions": args.positions, "vocab": args.vocab,
        "hidden": args.hidden, "chunk_positions": chunk_positions(args.vocab, args.chunk), "exact": exact,
        "whole_s": statistics.median(seconds["whole"]), "chunked_s": statistics.median(seconds["chunked"]),
        "whole_peak_mb": max(peaks["whole"]), "chunked_peak_mb": max(peaks["chunked"]),
    }  # fmt: skip
    logits_mb = args.positions * args.vocab * 4 / 2**20
    print(
        f"head {args.hidden} x {args.vocab}, {args.positions} scored positions, {args.dtype} logits on {args.device} "
        f"(one float32 [K, V] tensor: {logits_mb:.0f} MB); chunks of {result['chunk_positions']} positions; "
        f"median of {args.rounds}"
    )
    for name in ("whole", "chunked"):
        print(f"  {name:<8} {result[name + '_s']:8.3f} s   peak {result[name + '_peak_mb']:9.0f} MB")
    print(
        f"chunked / whole: time {result['chunked_s'] / result['whole_s']:.2f}x, "
        f"peak memory {result['chunked_peak_mb'] / max(result['whole_peak_mb'], 1e-9):.2f}x; "
        f"bit-identical values and gradients: {'yes' if exact else 'NO'}"
        + ("" if device.type == "cpu" else " (on CUDA not promised: kernels may reduce in another order)")
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the logits' dtype")
    parser.add_argument("--positions", type=int, default=1024, help="scored positions K")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk", type=int, help="positions per chunk (default: the backends' default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="K=512, vocabulary 32,768, chunks of 64, 2 rounds")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.quick:
        args.positions, args.vocab, args.rounds, args.chunk = 512, 32_768, 2, args.chunk or 64
    if args.device == "cuda" and not torch.cuda.is_available():
        print("chunked_logprobs: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["exact"] or args.device == "cuda" else 1


if __name__ == "__main__":
    sys.exit(main())
