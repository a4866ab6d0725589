"""One training step on a ~0.5B model with the torch and the verl backend: step time, tokens/s, MFU,
micro-batches, and the export of the weights for the engine.

The model is built offline from Qwen2-0.5B's architecture numbers with random weights (no hub),
the batch is bench/train_step.py's ragged agent-like batch (GRPO, rollout-mean loss), and each
backend runs a warm-up step and then `--steps` timed steps; the median step is reported. Both
backends cut the batch into the same micro-batches (backends/packing.py `pack_samples`), so their
micro-batch counts agree at one verl worker.

MFU is model FLOPs per second over the GPU's peak (`--peak-tflops`, 989 = H200 bf16 dense), the
FLOPs a step needs whatever kernels run it (PaLM's convention, counted per token and per sample):

    matmuls     6 x N_layers x T        N_layers: the decoder layers' weight matrices (q, k, v, o, MLP),
                                        no embedding, no head; T: the batch's tokens
    attention   6 x d_attn x L x sum over samples of n (n + 1)
                                        causal: n (n + 1) / 2 query-key pairs a sample of n tokens,
                                        QK^T and AV at 2 d_attn FLOPs each, x3 for forward + backward
    output head 6 x H x V x K           only at the K scored positions (both backends run it nowhere else)

For Qwen2-0.5B: N_layers = 357.9 M (24 layers of 14.9 M), d_attn = 896, H x V = 136.1 M. The first
GPU run's figures used 6 x parameters x tokens (494 M parameters, embedding included, attention
not): printed as "6ND" for comparison.

On a GPU the torch backend keeps fp32 master weights with bf16 autocast, and verl's FSDP2 workers
do the same (model dtype fp32, compute bf16). `--device cpu` runs the same code on a tiny model on
the CPU (unless `--model` says otherwise; `--model small` is a 41 M-parameter Qwen2 for the export's
cost); its MFU is against the given peak, meaningless for a CPU but computed the same way.

    python bench/gpu_step.py --device cuda                 # both backends, ~0.5B, scripts/gpu_check.sh
    python bench/gpu_step.py --device cuda --backend torch --attn flex_attention
    python bench/gpu_step.py --device cpu --backend torch --steps 1
    python bench/gpu_step.py --device cpu --model small --tasks 2 --per-task 2 --max-len 256 --exports 5
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
SMALL = {  # 41 M parameters: the export's cost on a CPU
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "vocab_size": 32768, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip
TINY = {
    "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 2048, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip
MODELS = {"0.5b": QWEN2_0_5B, "small": SMALL, "tiny": TINY}


@dataclass
class StepResult:
    backend: str
    device: str
    parameters: int
    tokens: int  # real tokens of the batch (prompt + completion), per step
    step_s: float  # median
    tokens_per_s: float
    mfu: float  # model FLOPs (module docstring) / step_s / peak
    loss: float
    workers: int = 1
    micro_batches: int = 0  # forward/backward passes in the step (perf/micro_batches)
    export_s: float = 0.0  # state_dict_for_engine(bf16), median of --exports: the weights the engine gets
    model_flops: float = 0.0  # per step
    mfu_6nd: float = 0.0  # 6 x parameters x tokens / step_s / peak: the first GPU run's figure
    padding_frac: float = 0.0
    attn: str = ""  # the attention implementation asked for ("" = the backend's default)


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
    """6ND: the first GPU run's figure (embedding counted for every token, attention not)."""
    return 6.0 * parameters * tokens / seconds / (peak_tflops * 1e12)


def layer_matrix_parameters(architecture: dict[str, Any]) -> int:
    """The decoder layers' weight matrices (q, k, v, o and the gated MLP's three), biases and norms left out."""
    h, layers = architecture["hidden_size"], architecture["num_hidden_layers"]
    head_dim = architecture.get("head_dim") or h // architecture["num_attention_heads"]
    q = architecture["num_attention_heads"] * head_dim
    kv = architecture["num_key_value_heads"] * head_dim
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * architecture["intermediate_size"])


def model_flops(architecture: dict[str, Any], batch: TrainingBatch) -> float:
    """A step's model FLOPs (forward + backward, module docstring): matmuls per token, causal attention
    per sample, the output head at the scored positions only."""
    h = architecture["hidden_size"]
    d_attn = architecture["num_attention_heads"] * (architecture.get("head_dim") or h // architecture["num_attention_heads"])
    lengths = batch.attention_mask.sum(-1).double()
    tokens = float(lengths.sum())
    scored = float(batch.loss_mask[:, 1:].sum())  # nothing predicts a sample's first token
    matmuls = 6.0 * layer_matrix_parameters(architecture) * tokens
    attention = 6.0 * d_attn * architecture["num_hidden_layers"] * float((lengths * (lengths + 1)).sum())
    head = 6.0 * h * architecture["vocab_size"] * scored
    return matmuls + attention + head


def make_backend(
    name: str, model_dir: Path, device: str, workers: int, micro_batch_tokens: int, attn: str | None = None
) -> Any:
    training = TorchBackendConfig(
        model_path=model_dir,
        device=device,
        lr=1e-6,
        micro_batch_tokens=micro_batch_tokens,
        attn_implementation=attn,
        algorithm=AlgorithmConfig(advantage_estimator="grpo", loss_agg_mode="rollout-mean"),
    )
    if name == "torch":
        return TorchBackend(training)
    from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig

    return VerlBackend(VerlBackendConfig(training=training, nnodes=1, n_gpus_per_node=workers))


def measure(
    backend: Any, batch: TrainingBatch, steps: int, device: str, exports: int = 1
) -> tuple[list[float], dict[str, float]]:
    """The timed steps' seconds and the last step's metrics, with `perf/export_s`: the median seconds of
    `exports` exports of the weights for the engine in bf16 (what a weight sync starts with)."""

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
    export_times = []
    for _ in range(exports):
        sync()
        started = time.perf_counter()
        weights = backend.state_dict_for_engine(torch.bfloat16)
        export_times.append(time.perf_counter() - started)
        del weights
    metrics["perf/export_s"] = statistics.median(export_times)
    return times, metrics


def run(args: argparse.Namespace) -> list[StepResult]:
    architecture = MODELS[args.model]
    names = ["torch", "verl"] if args.backend == "both" else [args.backend]
    results: list[StepResult] = []
    with tempfile.TemporaryDirectory(prefix="agl-gpu-step-") as tmp:
        if args.model_dir is not None and (args.model_dir / "config.json").is_file():
            model_dir = args.model_dir  # built by an earlier call (scripts/gpu_check.sh runs several)
        else:
            model_dir = build_model(args.model_dir or Path(tmp) / "model", architecture)
        from agl_trainer.resources import safetensors_parameters

        parameters = safetensors_parameters(model_dir) or 0
        batch = ragged_batch(args.tasks, args.per_task, architecture["vocab_size"], args.max_len, seed=0)
        tokens = int(batch.attention_mask.sum())
        flops = model_flops(architecture, batch)
        print(
            f"model: Qwen2 {args.model} ({parameters / 1e6:.1f} M parameters), device {args.device}; batch "
            f"{batch.num_rollouts} rollouts, {batch.num_samples} samples, {tokens} tokens "
            f"({int(batch.loss_mask.sum())} scored); {flops / 1e12:.2f} TFLOP a step (model FLOPs); "
            f"micro_batch_tokens {args.micro_batch_tokens}",
            flush=True,
        )
        for name in names:
            attn = args.attn
            backend = make_backend(name, model_dir, args.device, args.workers, args.micro_batch_tokens, attn)
            try:
                times, metrics = measure(backend, batch, args.steps, args.device, args.exports)
            finally:
                close = getattr(backend, "close", None)
                if close is not None:
                    close()
            step = statistics.median(times)
            peak = args.peak_tflops * 1e12
            result = StepResult(
                backend=name, device=args.device, parameters=parameters, tokens=tokens, step_s=step,
                tokens_per_s=tokens / step, mfu=flops / step / peak,
                loss=float(metrics.get("loss/total", 0.0)), workers=args.workers if name == "verl" else 1,
                micro_batches=int(metrics.get("perf/micro_batches", 0)), export_s=metrics["perf/export_s"],
                model_flops=flops, mfu_6nd=mfu(parameters, tokens, step, args.peak_tflops),
                padding_frac=float(metrics.get("perf/padding_frac", 0.0)), attn=attn or "",
            )  # fmt: skip
            results.append(result)
            print(
                f"{name:<6} step {step:8.3f} s  {result.tokens_per_s:12.0f} tokens/s  MFU {result.mfu:7.2%} "
                f"(6ND {result.mfu_6nd:6.2%}; peak {args.peak_tflops:g} TFLOP/s)  loss {result.loss:.4f}  "
                f"{result.micro_batches} micro-batches (padding {result.padding_frac:.1%})  "
                f"weights export (bf16) {result.export_s:.3f} s" + (f"  attention {attn}" if attn else ""),
                flush=True,
            )
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if len(results) == 2:
        torch_result, verl_result = results
        print(
            f"verl / torch: step time {verl_result.step_s / torch_result.step_s:.2f}x, weights export "
            f"{verl_result.export_s / torch_result.export_s:.2f}x, micro-batches {verl_result.micro_batches} / "
            f"{torch_result.micro_batches}"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["torch", "verl", "both"], default="both")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--model", choices=list(MODELS), help="Qwen2 shape: 0.5b (default on cuda), small (41 M), tiny (default on cpu)"
    )
    parser.add_argument("--tiny", action="store_true", help="the same as --model tiny")
    parser.add_argument(
        "--attn", help="attention implementation for both backends (sdpa, flex_attention, flash_attention_2)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--exports", type=int, default=1, help="weight exports timed after the steps (median)")
    parser.add_argument("--workers", type=int, default=1, help="verl workers (GPUs; processes on a CPU)")
    parser.add_argument("--tasks", type=int, default=16, help="task groups in the batch")
    parser.add_argument("--per-task", type=int, default=4, help="rollouts per task")
    parser.add_argument("--max-len", type=int, default=2048, help="longest sample")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--model-dir", type=Path, help="build the model here once and reuse it (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.workers < 1 or args.exports < 1 or args.peak_tflops <= 0:
        parser.error("--steps, --workers and --exports must be >= 1 and --peak-tflops > 0")
    args.model = "tiny" if args.tiny else args.model or ("0.5b" if args.device == "cuda" else "tiny")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: --device cuda, but torch sees no CUDA device (use --device cpu here)", file=sys.stderr)
        return 2
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
