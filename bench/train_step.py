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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smaller batch and fewer repeats (< 1 minute)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--token-budget", type=int, default=4096, help="positions per micro-batch")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tasks, per_task, repeats, max_len = (3, 4, 2, 384) if args.quick else (8, 4, 3, 1024)

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
                return backend.train_step(b)["perf/padding_frac"]

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
