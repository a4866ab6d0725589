"""One training step on a ~0.5B model with the torch and the verl backend: tokens/s and MFU.

The model is built offline from Qwen2-0.5B's architecture numbers with random weights (no hub),
the batch is bench/train_step.py's ragged agent-like batch (GRPO, rollout-mean loss), and each
backend runs a warm-up step and then `--steps` timed steps; the median step is reported.

    MFU = 6 x parameters x tokens / step seconds / peak FLOP/s      (peak: --peak-tflops, 989 = H200 bf16 dense)

On a GPU the torch backend keeps fp32 master weights with bf16 autocast, and verl's FSDP2 workers
do the same (model dtype fp32, compute bf16). `--device cpu --tiny` runs the same code on a tiny
model on the CPU (what the quick test exercises); its MFU is against the given peak, meaningless
for a CPU but computed the same way.

    python bench/gpu_step.py --device cuda                 # both backends, ~0.5B, scripts/gpu_check.sh
    python bench/gpu_step.py --device cpu --tiny --backend torch --steps 1
    python bench/gpu_step.py ... --json out.json           # the numbers, for scripts and tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from train_step import ragged_batch  # noqa: E402 - bench/ is not a package

from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import TorchBackend, TorchBackendConfig
from agl_trainer.batch import TrainingBatch

H200_BF16_DENSE_TFLOPS = 989.0
QWEN2_0_5B = {  # Qwen/Qwen2-0.5B config.json: 494,032,768 parameters
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
TINY = {
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 2048, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip


@dataclass
class StepResult:
    backend: str
    device: str
    parameters: int
    tokens: int  # real tokens of the batch (prompt + completion), per step
    step_s: float  # median
    tokens_per_s: float
    mfu: float
    loss: float
    workers: int = 1
    micro_batches: int = 0  # forward/backward passes in the step (perf/micro_batches)
    export_s: float = 0.0  # state_dict_for_engine(bf16): the weights the engine gets after a step


def build_model(directory: Path, architecture: dict[str, Any]) -> Path:
    """A Qwen2 model with random weights and a small BPE tokenizer, saved offline."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from agl_trainer.models.tiny import build_bpe_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**architecture))
    model.save_pretrained(directory)
    build_bpe_tokenizer(None, 384).save_pretrained(directory)
    return directory


def mfu(parameters: int, tokens: int, seconds: float, peak_tflops: float) -> float:
    return 6.0 * parameters * tokens / seconds / (peak_tflops * 1e12)


def make_backend(name: str, model_dir: Path, device: str, workers: int, micro_batch_tokens: int) -> Any:
    training = TorchBackendConfig(
        model_path=model_dir,
        device=device,
        lr=1e-6,
        micro_batch_tokens=micro_batch_tokens,
        algorithm=AlgorithmConfig(advantage_estimator="grpo", loss_agg_mode="rollout-mean"),
    )
    if name == "torch":
        return TorchBackend(training)
    from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig

    return VerlBackend(VerlBackendConfig(training=training, nnodes=1, n_gpus_per_node=workers))


def measure(
    backend: Any, batch: TrainingBatch, steps: int, device: str
) -> tuple[list[float], dict[str, float]]:
    """The timed steps' seconds and the last step's metrics, with `perf/export_s`: the seconds of one
    export of the weights for the engine in bf16 (what a weight sync starts with)."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    backend.train_step(batch, 0)  # warm-up: allocator, kernels, Ray dispatch paths
    times, metrics = [], {}
    for step in range(steps):
        sync()
        started = time.perf_counter()
        metrics = backend.train_step(batch, step + 1)  # the policy version a run would be at
        sync()
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    backend.state_dict_for_engine(torch.bfloat16)
    metrics["perf/export_s"] = time.perf_counter() - started
    return times, metrics


def run(args: argparse.Namespace) -> list[StepResult]:
    architecture = TINY if args.tiny else QWEN2_0_5B
    names = ["torch", "verl"] if args.backend == "both" else [args.backend]
    results: list[StepResult] = []
    with tempfile.TemporaryDirectory(prefix="agl-gpu-step-") as tmp:
        model_dir = build_model(Path(tmp) / "model", architecture)
        from agl_trainer.resources import safetensors_parameters

        parameters = safetensors_parameters(model_dir) or 0
        batch = ragged_batch(args.tasks, args.per_task, architecture["vocab_size"], args.max_len, seed=0)
        tokens = int(batch.attention_mask.sum())
        print(
            f"model: Qwen2 {'tiny' if args.tiny else '0.5B'} ({parameters / 1e6:.1f} M parameters), device "
            f"{args.device}; batch {batch.num_rollouts} rollouts, {batch.num_samples} samples, {tokens} tokens",
            flush=True,
        )
        for name in names:
            backend = make_backend(name, model_dir, args.device, args.workers, args.micro_batch_tokens)
            try:
                times, metrics = measure(backend, batch, args.steps, args.device)
            finally:
                close = getattr(backend, "close", None)
                if close is not None:
                    close()
            step = statistics.median(times)
            result = StepResult(
                backend=name, device=args.device, parameters=parameters, tokens=tokens, step_s=step,
                tokens_per_s=tokens / step, mfu=mfu(parameters, tokens, step, args.peak_tflops),
                loss=float(metrics.get("loss/total", 0.0)), workers=args.workers if name == "verl" else 1,
                micro_batches=int(metrics.get("perf/micro_batches", 0)), export_s=metrics["perf/export_s"],
            )  # fmt: skip
            results.append(result)
            print(
                f"{name:<6} step {step:8.3f} s  {result.tokens_per_s:12.0f} tokens/s  MFU {result.mfu:7.2%} "
                f"(peak {args.peak_tflops:g} TFLOP/s)  loss {result.loss:.4f}  "
                f"{result.micro_batches} micro-batches  weights export (bf16) {result.export_s:.3f} s",
                flush=True,
            )
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if len(results) == 2:
        print(f"verl / torch step time: {results[1].step_s / results[0].step_s:.2f}x")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["torch", "verl", "both"], default="both")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2 instead of the 0.5B one (CPU checks)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--workers", type=int, default=1, help="verl workers (GPUs; processes on a CPU)")
    parser.add_argument("--tasks", type=int, default=16, help="task groups in the batch")
    parser.add_argument("--per-task", type=int, default=4, help="rollouts per task")
    parser.add_argument("--max-len", type=int, default=2048, help="longest sample")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.workers < 1 or args.peak_tflops <= 0:
        parser.error("--steps and --workers must be >= 1 and --peak-tflops > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: --device cuda, but torch sees no CUDA device (use --device cpu --tiny here)", file=sys.stderr)
        return 2
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
