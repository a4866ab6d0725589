"""Training-step throughput on a tiny causal LM on the CPU: packed micro-batches vs a naive padded batch.

Both run the same objective (GRPO advantages, rollout-mean PPO loss) on the same ragged batch of
agent-like samples (lognormal lengths, long prompts, short completions) in this process:

  packed      TorchBackend: first-fit-decreasing packing, position_ids resets, logits only where trained
  sorted-pad  TorchBackend with packing="padded": one sample per row, rows sorted by length
  naive       every sample padded to the longest, fixed rows per micro-batch, full logits (the reference)

Prints tokens per second of wall time and per CPU-second of this process (real tokens: prompt +
completion; modes interleaved round by round), the ratio against the naive reference measured in the
same run, and the fraction of positions spent on padding.

    python bench/train_step.py            # about 2 minutes on 2 idle cores
    python bench/train_step.py --quick    # under a minute

`--backend verl` measures the verl backend instead (verl's FSDP2 workers in Ray, CPU processes
here) against the torch backend (packed) on the same batch, world size 1 and 2, interleaved; then
the fixed cost of a step (Ray dispatch, batch transfer, the workers' bookkeeping) as the step time on
a tiny batch (two one-sample rollouts) minus the torch backend's, and verl's own perf/dispatch_s. Goal: world size 1
within 1.5x of the torch backend's step time.

    python bench/train_step.py --backend verl --quick

`--lora 8,32` measures LoRA instead: the torch backend (packed) training every weight (the reference)
vs adapters of each rank over the frozen base (backend.lora: the default targets, or --lora-targets
all-linear), interleaved on the same batch, on a larger model by default (hidden 256, 4 layers: at
hidden 128 a rank-32 adapter is hardly low-rank). Memory, per mode:
  state MB   what stays resident between steps for training: the trainable parameters' gradients and
             AdamW's two moments, summed over those tensors (exact; the frozen weights are shared)
  peak MB    the process's peak resident set during the step above its resident set just before it
             (VmHWM reset through /proc/self/clear_refs; glibc's mmap threshold is pinned at 128 KiB so
             freed tensors leave the resident set): activations, logits and other transients
The ratio against full training is of state + peak.

    python bench/train_step.py --lora 8,32 --quick
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from agl_trainer.algorithms import (
    AlgorithmConfig,
    broadcast_to_tokens,
    compute_rollout_advantages,
    rl_objective,
    token_weights,
)
from agl_trainer.backends import TorchBackend, TorchBackendConfig
from agl_trainer.batch import RolloutResult, Sample, TrainingBatch


def build_model(directory: Path, vocab: int, hidden: int, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def ragged_batch(num_tasks: int, per_task: int, vocab: int, max_len: int, seed: int = 0) -> TrainingBatch:
    """Rollouts of 1-4 calls; each call's sample is a long prompt plus a short completion."""
    rng = random.Random(seed)
    rollouts = []
    for task in range(num_tasks):
        for attempt in range(per_task):
            rid = f"t{task}-{attempt}"
            samples = []
            for _ in range(rng.randint(1, 4)):
                length = int(min(max_len, max(24, rng.lognormvariate(5.0, 0.8))))
                completion = max(1, int(length * rng.uniform(0.1, 0.4)))
                prompt = length - completion
                ids = [rng.randrange(vocab) for _ in range(length)]
                samples.append(
                    Sample(
                        rid,
                        f"t{task}",
                        ids,
                        [0] * prompt + [1] * completion,
                        [0.0] * prompt + [-rng.uniform(1, 6) for _ in range(completion)],
                        [-1] * prompt + [0] * completion,
                    )
                )
            rollouts.append(RolloutResult(rid, f"t{task}", rng.random(), samples))
    return TrainingBatch.from_rollouts(rollouts)


class NaivePaddedTrainer:
    """The reference: the padded batch as assembled, fixed chunks of rows, logits at every position."""

    def __init__(self, backend: TorchBackend, rows_per_micro_batch: int) -> None:
        self.model, self.optimizer, self.rows = backend.model, backend.optimizer, rows_per_micro_batch
        self.algorithm = backend.config.algorithm

    def train_step(self, batch: TrainingBatch) -> float:
        """One update; returns the fraction of positions that were padding."""
        algo = self.algorithm
        adv = compute_rollout_advantages(
            batch.rollout_rewards, batch.rollout_group_index, algo.advantage_estimator
        )
        mask = batch.loss_mask.float()
        advantages = broadcast_to_tokens(adv.values, batch.rollout_index, mask)
        weights = token_weights(mask, batch.rollout_index, algo.loss_agg_mode)
        self.optimizer.zero_grad(set_to_none=True)
        for chunk in torch.arange(batch.num_samples).split(self.rows):
            logits = self.model(
                input_ids=batch.input_ids[chunk],
                attention_mask=batch.attention_mask[chunk],
                position_ids=batch.position_ids[chunk],
                use_cache=False,
            ).logits.float()
            log_prob = torch.zeros(len(chunk), batch.input_ids.shape[1])
            log_prob[:, 1:] = (
                torch.log_softmax(logits[:, :-1], -1)
                .gather(-1, batch.input_ids[chunk, 1:].unsqueeze(-1))
                .squeeze(-1)
            )
            out = rl_objective(
                algo,
                log_prob=log_prob,
                old_log_prob=log_prob.detach(),
                advantages=advantages[chunk],
                weights=weights[chunk],
            )
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return 1 - int(batch.attention_mask.sum()) / batch.input_ids.numel()


@dataclass
class Measured:
    wall: list[float] = field(default_factory=list)  # seconds per step
    cpu: list[float] = field(default_factory=list)  # CPU seconds of this process per step
    padding: float = 0.0


def measure_interleaved(steps: dict, batch: TrainingBatch, repeats: int) -> dict[str, Measured]:
    """Round-robin over the modes, so load from other processes hits them alike; CPU time of this
    process is reported beside wall time because it is what other processes disturb least."""
    results = {name: Measured() for name in steps}
    for name, step in steps.items():
        print(f"  warm-up {name}", flush=True)
        step(batch)
    for repeat in range(repeats):
        print(f"  round {repeat + 1}/{repeats}", flush=True)
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            results[name].padding = step(batch)
            results[name].wall.append(time.perf_counter() - wall)
            results[name].cpu.append(time.process_time() - cpu)
    return results


def tiny_batch(vocab: int, rollouts: int = 2, length: int = 64, seed: int = 1) -> TrainingBatch:
    """One short sample per rollout, one rollout per data-parallel rank at world size 2: what a
    step costs when there is (almost) nothing to train."""
    rng = random.Random(seed)
    prompt = length // 2
    results = []
    for index in range(rollouts):
        ids = [rng.randrange(vocab) for _ in range(length)]
        sample = Sample(f"r{index}", "t0", ids, [0] * prompt + [1] * (length - prompt),
                        [0.0] * prompt + [-1.0] * (length - prompt), [-1] * prompt + [0] * (length - prompt))  # fmt: skip
        results.append(RolloutResult(f"r{index}", "t0", float(index), [sample]))
    return TrainingBatch.from_rollouts(results)


def _pool(into: dict[str, Measured], measured: dict[str, Measured]) -> None:
    for name, m in measured.items():
        target = into.setdefault(name, Measured())
        target.wall += m.wall
        target.cpu += m.cpu


def verl_main(args: argparse.Namespace, tasks: int, per_task: int, repeats: int, max_len: int) -> int:
    from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the workers get what this process has
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.vocab, args.hidden, args.layers)
        batch = ragged_batch(tasks, per_task, args.vocab, max_len)
        algorithm = AlgorithmConfig(advantage_estimator="grpo", loss_agg_mode="rollout-mean")

        def training() -> TorchBackendConfig:
            return TorchBackendConfig(model_path=model_dir, device="cpu", lr=1e-5,
                                      micro_batch_tokens=args.token_budget, algorithm=algorithm)  # fmt: skip

        reference = TorchBackend(training())
        tokens = int(batch.attention_mask.sum())
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch: "
            f"{batch.num_rollouts} rollouts, {batch.num_samples} samples, {tokens} tokens; torch threads "
            f"{args.threads} in this process and in each verl worker"
        )
        one = tiny_batch(args.vocab)
        full: dict[str, Measured] = {}
        single: dict[str, Measured] = {}
        dispatch: dict[str, list[float]] = {}
        worker_cpu: dict[str, list[float]] = {}  # verl: CPU seconds of rank 0 per step (perf/worker_cpu_s)
        # One verl backend at a time (each sizes its own Ray cluster), interleaved with the torch
        # backend so both see the same load; the torch numbers of both rounds are pooled.
        for world in (1, 2):
            name = f"verl-{world}"
            verl = VerlBackend(VerlBackendConfig(training=training(), n_gpus_per_node=world))
            dispatch[name], worker_cpu[name] = [], []
            try:

                def verl_step(b: TrainingBatch, backend: Any = verl, name: str = name) -> float:
                    metrics = backend.train_step(b, 1)  # the batch's tokens (version 0) are stale
                    dispatch[name].append(metrics.get("perf/dispatch_s", float("nan")))
                    worker_cpu[name].append(metrics.get("perf/worker_cpu_s", float("nan")))
                    return metrics.get("perf/padding_frac", 0.0)

                def torch_step(b: TrainingBatch) -> float:
                    return reference.train_step(b, 1)["perf/padding_frac"]

                print(f"{name}: full batch")
                measured = measure_interleaved({"torch": torch_step, name: verl_step}, batch, repeats)
                _pool(full, measured)
                cpu_full = statistics.median(worker_cpu[name][-repeats:])
                worker_cpu[name] = [cpu_full]
                dispatch[name].clear()
                print(f"{name}: two one-sample rollouts (fixed cost per step)")
                _pool(single, measure_interleaved({"torch": torch_step, name: verl_step}, one, repeats))
            finally:
                verl.close()
    step = {name: statistics.median(m.wall) for name, m in full.items()}
    fixed = {name: statistics.median(m.wall) for name, m in single.items()}
    # CPU seconds of the process that computes (this one for torch, verl's rank 0): steadier than wall
    # time on a shared machine; a verl rank's CPU time excludes Ray dispatch (see the fixed cost).
    cpu = {"torch": statistics.median(full["torch"].cpu), **{n: worker_cpu[n][0] for n in worker_cpu}}
    print(f"{'backend':<9}{'step s':>9}{'tokens/s':>10}{'vs torch':>10}{'cpu s':>8}{'vs torch':>10}"
          f"{'tiny step s':>13}{'fixed cost s':>14}{'dispatch_s (tiny)':>19}")  # fmt: skip
    for name in full:
        extra = fixed[name] - fixed["torch"]
        ray = statistics.median(dispatch[name]) if dispatch.get(name) else float("nan")
        print(
            f"{name:<9}{step[name]:>9.3f}{tokens / step[name]:>10.0f}{step[name] / step['torch']:>9.2f}x"
            f"{cpu[name]:>8.3f}{cpu[name] / cpu['torch']:>9.2f}x"
            f"{fixed[name]:>13.3f}{extra if name != 'torch' else 0.0:>14.3f}{ray:>19.3f}"
        )
    ratio = step["verl-1"] / step["torch"]
    print(f"verl world size 1 / torch step time: {ratio:.2f}x (goal <= 1.5x): {'OK' if ratio <= 1.5 else 'MISSED'}")
    return 0 if ratio <= 1.5 else 1


def pin_malloc() -> None:
    """glibc raises its mmap threshold as large blocks are freed, so a freed tensor's memory would stay in
    the heap and in the resident set; a fixed threshold returns every tensor above 128 KiB to the system."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (fixing it also stops the dynamic adjustment)
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD: give freed heap tops back too


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key + ":"))


def step_peak_mb(step: Any) -> Any:
    """`step` that records the resident set's rise during each call (MB) in `.peaks`."""
    peaks: list[float] = []

    def measured(batch: TrainingBatch) -> float:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM := VmRSS
        before = _status_kb("VmRSS")
        padding = step(batch)
        peaks.append((_status_kb("VmHWM") - before) / 1024)
        return padding

    measured.peaks = peaks  # type: ignore[attr-defined]
    return measured


def training_state_mb(backend: TorchBackend) -> float:
    """Gradients of the trainable parameters plus AdamW's state: what training keeps beside the weights."""
    trainable = [p for p in backend.model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)  # allocated by every step's backward
    moments = sum(t.numel() * t.element_size() for state in backend.optimizer.state.values()
                  for t in state.values() if torch.is_tensor(t) and t.dim() > 0)  # fmt: skip
    return (grads + moments) / 2**20


def lora_main(args: argparse.Namespace, tasks: int, per_task: int, repeats: int, max_len: int) -> int:
    from agl_trainer.backends.torch_config import LoraConfig

    ranks = [int(r) for r in args.lora.split(",")]
    pin_malloc()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.vocab, args.hidden, args.layers)
        batch = ragged_batch(tasks, per_task, args.vocab, max_len)
        algorithm = AlgorithmConfig(advantage_estimator="grpo", loss_agg_mode="rollout-mean")
        targets = tuple(args.lora_targets.split(",")) if args.lora_targets else None
        backends = {}
        for rank in [0, *ranks]:
            adapters = LoraConfig(rank=rank, **({"target_modules": targets} if targets and rank else {}))
            backends["full" if rank == 0 else f"lora-{rank}"] = TorchBackend(
                TorchBackendConfig(model_path=model_dir, device="cpu", lr=1e-5, packing="packed",
                                   micro_batch_tokens=args.token_budget, algorithm=algorithm, lora=adapters)
            )  # fmt: skip
        steps = {
            name: step_peak_mb(lambda b, backend=backend: backend.train_step(b, 1)["perf/padding_frac"])
            for name, backend in backends.items()
        }
        full = backends["full"].model
        weights = sum(p.numel() * p.element_size() for p in full.parameters()) / 2**20
        parameters = sum(p.numel() for p in full.parameters())
        tokens = int(batch.attention_mask.sum())
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
            f"{parameters / 1e6:.2f}M parameters ({weights:.1f} MB float32); batch: "
            f"{batch.num_rollouts} rollouts, {batch.num_samples} samples, {tokens} tokens "
            f"({int(batch.loss_mask.sum())} trained); targets {args.lora_targets or 'the default'}; "
            f"torch threads {args.threads}"
        )
        results = measure_interleaved(steps, batch, repeats)
        trainable = {n: sum(p.numel() for p in b.model.parameters() if p.requires_grad)
                     for n, b in backends.items()}  # fmt: skip
        state = {name: training_state_mb(backend) for name, backend in backends.items()}
    wall = {name: statistics.median(m.wall) for name, m in results.items()}
    cpu = {name: statistics.median(m.cpu) for name, m in results.items()}
    peak = {name: statistics.median(step.peaks[1:]) for name, step in steps.items()}  # [0]: warm-up
    total = {name: state[name] + peak[name] for name in steps}
    print(f"{'mode':<9}{'trainable':>11}{'step s':>8}{'vs full':>9}{'cpu s':>8}{'vs full':>9}"
          f"{'state MB':>10}{'peak MB':>9}{'state+peak':>12}{'vs full':>9}")  # fmt: skip
    for name in steps:
        print(
            f"{name:<9}{trainable[name] / 1e6:>10.3f}M{wall[name]:>8.3f}{wall[name] / wall['full']:>8.2f}x"
            f"{cpu[name]:>8.3f}{cpu[name] / cpu['full']:>8.2f}x{state[name]:>10.1f}{peak[name]:>9.1f}"
            f"{total[name]:>12.1f}{total[name] / total['full']:>8.2f}x"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smaller batch and fewer repeats (< 1 minute)")
    parser.add_argument("--hidden", type=int, default=None, help="default 128 (--lora: 256)")
    parser.add_argument("--layers", type=int, default=None, help="default 2 (--lora: 4)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--token-budget", type=int, default=4096, help="positions per micro-batch")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)"
    )
    parser.add_argument("--backend", choices=["torch", "verl"], default="torch",
                        help="torch: packing vs padding (default); verl: the verl backend vs the torch backend")  # fmt: skip
    parser.add_argument("--lora", default=None, metavar="RANKS",
                        help="LoRA ranks (8,32): full training vs adapters of each")  # fmt: skip
    parser.add_argument("--lora-targets", default=None, help="with --lora: all-linear, or module names")
    args = parser.parse_args()
    args.hidden = args.hidden or (256 if args.lora else 128)
    args.layers = args.layers or (4 if args.lora else 2)
    torch.set_num_threads(args.threads)
    tasks, per_task, repeats, max_len = (3, 4, 2, 384) if args.quick else (8, 4, 3, 1024)
    if args.lora:
        return lora_main(args, tasks, per_task, repeats, max_len)
    if args.backend == "verl":
        return verl_main(args, tasks, per_task, repeats, max_len)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.vocab, args.hidden, args.layers)
        batch = ragged_batch(tasks, per_task, args.vocab, max_len)
        algorithm = AlgorithmConfig(advantage_estimator="grpo", loss_agg_mode="rollout-mean")
        make = lambda packing: TorchBackend(
            TorchBackendConfig(
                model_path=model_dir,
                device="cpu",
                lr=1e-5,
                micro_batch_tokens=args.token_budget,
                packing=packing,
                algorithm=algorithm,
            )
        )

        def backend_step(backend: TorchBackend):
            def step(b: TrainingBatch) -> float:
                return backend.train_step(b, 1)["perf/padding_frac"]

            return step

        rows = max(1, args.token_budget // batch.input_ids.shape[1])
        lengths = batch.attention_mask.sum(-1)
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch: "
            f"{batch.num_rollouts} rollouts, {batch.num_samples} samples, {int(lengths.sum())} tokens "
            f"({int(batch.loss_mask.sum())} trained), lengths {int(lengths.min())}-{int(lengths.max())} "
            f"(median {int(lengths.median())}); budget {args.token_budget} positions per micro-batch"
        )
        steps = {
            "naive": NaivePaddedTrainer(make("padded"), rows).train_step,
            "sorted-pad": backend_step(make("padded")),
            "packed": backend_step(make("packed")),
        }
        results = measure_interleaved(steps, batch, repeats)
    tokens = int(lengths.sum())
    rate = {name: tokens / statistics.median(m.wall) for name, m in results.items()}
    cpu_rate = {name: tokens / statistics.median(m.cpu) for name, m in results.items()}
    print(f"{'mode':<12}{'tokens/s':>10}{'vs naive':>10}{'tokens/cpu-s':>14}{'vs naive':>10}{'padding':>9}")
    for name, m in results.items():
        print(
            f"{name:<12}{rate[name]:>10.0f}{rate[name] / rate['naive']:>9.2f}x{cpu_rate[name]:>14.0f}"
            f"{cpu_rate[name] / cpu_rate['naive']:>9.2f}x{m.padding:>9.1%}"
        )
    packed_padding = results["packed"].padding
    print(
        f"packed padding {packed_padding:.1%} (target < 10%): {'OK' if packed_padding < 0.10 else 'MISSED'}"
    )
    return 0 if packed_padding < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
