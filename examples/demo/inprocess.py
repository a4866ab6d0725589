"""The demo's RL loop in one process with no pipeline: the reference for the pipeline's overhead.

    from examples.demo.inprocess import InProcessRL, time_step
    rl = InProcessRL("runs/demo/model-warm", tasks_per_step=16, episodes_per_task=8, lr=1e-3)
    stats = rl.step()              # StepStats(reward, sample_s, train_s, seconds)
    seconds = time_step("runs/demo/model-warm")   # mean seconds of one step (after a warm-up step)

    python -m examples.demo.inprocess --steps 200       # train and print reward per step
    python -m examples.demo.inprocess --steps 100 --lora 8 --lr 3e-3   # LoRA (peft) instead
    python -m examples.demo.inprocess --steps 150 --held-out val   # + sampled reward on val pairs

A step: sample 16 tasks x 8 episodes (two batched calls each, as the harness makes them), reward
them, GRPO advantages per task group (agl_trainer.algorithms), one on-policy policy-gradient update
with the loss normalised per rollout (`rollout-mean`), AdamW. Both calls of an episode are trained
as one sequence when the second prompt extends the first call's prompt and completion (as the
trainer's assembly merges them), else as two rows.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.demo.episodes import DemoTokens, Episode, run_episodes
from examples.demo.task import check_split, make_tasks


@dataclass
class StepStats:
    reward: float
    sample_s: float
    train_s: float
    seconds: float
    loss: float


class InProcessRL:
    def __init__(
        self,
        model_path: str | Path,
        *,
        tasks_per_step: int = 16,
        episodes_per_task: int = 8,
        lr: float = 1e-3,
        seed: int = 0,
        num_tasks: int = 4096,
        torch_threads: int | None = 1,  # as the embedded engine: tiny ops are faster on one thread
        lora_rank: int = 0,  # > 0: train LoRA adapters (the demo config's targets) over a frozen base
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if torch_threads:
            torch.set_num_threads(torch_threads)

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokens = DemoTokens(self.tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if lora_rank:
            self.model = _with_lora(self.model, lora_rank, seed)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
        self.tasks = make_tasks(num_tasks, seed)
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.tasks_per_step, self.episodes_per_task = tasks_per_step, episodes_per_task

    def step(self) -> StepStats:
        started = time.perf_counter()
        chosen = self.rng.sample(self.tasks, self.tasks_per_step)
        self.model.eval()
        episodes = run_episodes(
            self.model,
            self.tokens,
            [t for t in chosen for _ in range(self.episodes_per_task)],
            generator=self.generator,
        )
        sampled = time.perf_counter()
        loss = self._update(episodes)
        done = time.perf_counter()
        reward = sum(e.reward for e in episodes) / len(episodes)
        return StepStats(reward, sampled - started, done - sampled, done - started, loss)

    def _update(self, episodes: Sequence[Episode]) -> float:
        import torch
        from agl_trainer.algorithms import compute_rollout_advantages, token_logprobs, token_weights

        rewards = torch.tensor([e.reward for e in episodes])
        group = torch.arange(len(episodes)) // self.episodes_per_task
        advantages = compute_rollout_advantages(rewards, group, "grpo").values
        rows, masks, owners = [], [], []
        for index, episode in enumerate(episodes):
            for ids, mask in _rows(episode):
                rows.append(ids)
                masks.append(mask)
                owners.append(index)
        width = max(len(r) for r in rows)
        pad = self.tokens.end
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width))
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (r, m) in enumerate(zip(rows, masks)):
            ids[row, : len(r)] = torch.as_tensor(r)
            loss_mask[row, : len(m)] = torch.as_tensor(m, dtype=torch.float32)
            attention[row, : len(r)] = 1
        owner = torch.as_tensor(owners)
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        logprobs = token_logprobs(logits, ids[:, 1:])
        mask = loss_mask[:, 1:]
        weights = token_weights(mask, owner, "rollout-mean")
        # on-policy, one update: the PPO ratio is 1, so the clipped loss is -A * logp
        loss = -(weights * advantages[owner][:, None] * logprobs).sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def _with_lora(model: Any, rank: int, seed: int) -> Any:
    """The model with LoRA adapters as the torch backend builds them (backends/lora.py: rank, its
    default alpha 16) on the demo config's targets: the projections and the output head."""
    from agl_trainer.backends import lora
    from agl_trainer.backends.torch_config import LoraConfig

    return lora.wrap(model, LoraConfig(rank=rank, target_modules=demo_lora_targets()), seed=seed)


DEMO_CONFIG = Path(__file__).with_name("config.yaml")


def demo_lora_targets(config: str | Path = DEMO_CONFIG) -> tuple[str, ...]:
    """backend.lora.target_modules of the demo's config (the default projections plus lm_head)."""
    import yaml

    return tuple(yaml.safe_load(Path(config).read_text())["backend"]["lora"]["target_modules"])


def _rows(episode: Episode) -> list[tuple[list[int], list[int]]]:
    """Training rows for an episode: one merged sequence when call 2's prompt extends call 1."""
    first = [*episode.prompt1, *episode.call1]
    full = [*episode.prompt2, *episode.call2]
    call2_mask = [0] * len(episode.prompt2) + [1] * len(episode.call2)
    if episode.prompt2[: len(first)] == first:
        mask = call2_mask.copy()
        for position in range(len(episode.prompt1), len(first)):
            mask[position] = 1
        return [(full, mask)]
    return [(first, [0] * len(episode.prompt1) + [1] * len(episode.call1)), (full, call2_mask)]


def time_step(model_path: str | Path, *, steps: int = 5, **kwargs: Any) -> float:
    """Mean wall-clock seconds of one in-process step (16 tasks x 8 episodes by default), after one
    warm-up step. The model is trained as it goes, as in a real run."""
    rl = InProcessRL(model_path, **kwargs)
    rl.step()
    return sum(rl.step().seconds for _ in range(steps)) / steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo.inprocess",
        description="Train the demo task in one process (no sidecar, no engine server): warm start, then GRPO.",
    )
    parser.add_argument("--workdir", default="runs/demo-inprocess", help="where the models go")
    parser.add_argument("--steps", type=int, default=200, help="RL steps (default 200)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lora", type=int, default=0, metavar="RANK",
        help="train LoRA adapters of this rank (the demo config's targets: the projections and lm_head)",
    )
    parser.add_argument(
        "--held-out", choices=("val", "test"), default=None,
        help="every 25 steps, the sampled reward (mean@4) on 64 tasks of this held-out split beside "
        "64 training tasks: does what RL learns carry over to (key, value) pairs it never shows?",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from examples.demo.prepare import prepare_demo_model

    prepared = prepare_demo_model(args.workdir, seed=args.seed)
    print(f"reward: random init {prepared.reward_init:.3f}, after warm start {prepared.reward_warm:.3f}")
    rl = InProcessRL(prepared.path, lr=args.lr, seed=args.seed, lora_rank=args.lora)
    compare = _held_out_comparison(rl, args.held_out, args.seed) if args.held_out else None
    for step in range(1, args.steps + 1):
        if compare and step % 25 == 1:
            compare(step - 1)
        stats = rl.step()
        if step % 10 == 0 or step == 1:
            print(
                f"step {step:4d} reward {stats.reward:.3f} ({stats.seconds * 1000:.0f} ms: "
                f"sample {stats.sample_s * 1000:.0f}, train {stats.train_s * 1000:.0f})"
            )
    if compare:
        compare(args.steps)
    return 0


def _held_out_comparison(rl: InProcessRL, split: str, seed: int) -> Any:
    """A printer of the sampled reward on fresh training tasks and on `split`'s tasks."""
    from examples.demo.episodes import mean_reward

    train = make_tasks(64, seed + 20_000)
    held_out = make_tasks(64, seed + 10_000, check_split(split))

    def compare(step: int) -> None:
        rl.model.eval()
        print(
            f"step {step:4d} sampled mean@4: training tasks {mean_reward(rl.model, rl.tokens, train):.3f}, "
            f"{split} tasks {mean_reward(rl.model, rl.tokens, held_out):.3f}"
        )

    return compare


if __name__ == "__main__":
    sys.exit(main())
