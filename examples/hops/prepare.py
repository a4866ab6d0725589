"""The hops example's starting model and task files.

    from examples.hops.prepare import prepare_hops
    prepared = prepare_hops("runs/hops", seed=0)
    prepared.path                     # runs/hops/model-warm: what RL starts from
    prepared.warm                     # test-split reward of the warm start: {"greedy", "sampled"}

The warm start is deliberately short (a few demonstrations, few steps): it teaches the format
(the main agent's `call <key>`, the sub-agent's lookup and answer) and leaves the copying to RL,
so the held-out reward has room to rise.

Two held-out splits, disjoint from training and from each other by what the model sees (each
chain's last lookup is a (key, value) pair training never shows: task.make_tasks): `val_tasks.jsonl`
(ids `val-...`), which the training run validates on and settings are chosen on, and
`test_tasks.jsonl` (ids `test-...`), which only `python -m examples.hops.run` reads, once, after
training, for the numbers it reports: nothing is chosen on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from examples.hops.task import demonstration, make_tasks

WARM_START_TASKS = 16
WARM_START_STEPS = 150
WARM_START_LR = 1e-3
WARM_START_HOPS = 1  # one-hop demonstrations: continuing a chain (3-4 hops, compactions) is for RL to find
TRAIN_TASKS = 512
VAL_TASKS = 64
TEST_TASKS = 64
EVAL_K = 4


@dataclass
class PreparedHops:
    path: Path
    tasks: Path
    val_tasks: Path
    test_tasks: Path
    warm: dict[str, float]  # on the test split
    warm_start_seconds: float


def train_tasks(n: int = TRAIN_TASKS, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, prefix="train")


def warm_start_tasks(
    n: int = WARM_START_TASKS, seed: int = 0, hops: int = WARM_START_HOPS
) -> list[dict[str, Any]]:
    return make_tasks(n, seed + 1, prefix="demo", max_hops=hops)


HELD_OUT_SEEDS = {"val": 10_000, "test": 20_000}  # added to the run's seed


def held_out_tasks(split: Literal["val", "test"], n: int = VAL_TASKS, seed: int = 0) -> list[dict[str, Any]]:
    """`val`: the training run's validation rounds, for choosing settings. `test`: for reported
    numbers only, never for choosing."""
    return make_tasks(n, HELD_OUT_SEEDS[split] + seed, prefix=split, split=split)


def val_tasks(n: int = VAL_TASKS, seed: int = 0) -> list[dict[str, Any]]:
    return held_out_tasks("val", n, seed)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prepare_hops(
    workdir: str | Path,
    *,
    seed: int = 0,
    steps: int = WARM_START_STEPS,
    demos: int = WARM_START_TASKS,
    demo_hops: int = WARM_START_HOPS,
    progress: bool = False,
) -> PreparedHops:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.demo.warmstart import Demonstration, WarmStartConfig, supervised_warm_start
    from examples.hops.model import build_hops_model
    from examples.hops.play import evaluate
    from examples.hops.tokens import HopsTokens

    workdir = Path(workdir)
    initial = build_hops_model(workdir / "model-init", seed=seed)
    tokens = HopsTokens(AutoTokenizer.from_pretrained(initial))
    shown = [
        Demonstration(*tokens.demonstration(conversation))
        for task in warm_start_tasks(demos, seed, demo_hops)
        for conversation in demonstration(task)
    ]
    result = supervised_warm_start(
        initial,
        workdir / "model-warm",
        shown,
        WarmStartConfig(steps=steps, lr=WARM_START_LR, seed=seed),
        progress=progress,
    )
    test = held_out_tasks("test", TEST_TASKS, seed)
    warm = evaluate(
        AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32),
        tokens,
        test,
        k=EVAL_K,
        seed=seed,
    )
    tasks = write_jsonl(workdir / "tasks.jsonl", train_tasks(seed=seed))
    val = write_jsonl(workdir / "val_tasks.jsonl", val_tasks(seed=seed))
    test_path = write_jsonl(workdir / "test_tasks.jsonl", test)
    return PreparedHops(result.path, tasks, val, test_path, warm, result.seconds)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m examples.hops.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", default="runs/hops",
        help="directory for model-warm/, tasks.jsonl, val_tasks.jsonl, test_tasks.jsonl",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    prepared = prepare_hops(args.out, seed=args.seed)
    print(
        f"hops: warm start in {prepared.warm_start_seconds:.1f} s; test-split reward greedy "
        f"{prepared.warm['greedy']:.3f}, sampled mean@{EVAL_K} {prepared.warm['sampled']:.3f}; wrote "
        f"{prepared.path}, {prepared.tasks}, {prepared.val_tasks}, {prepared.test_tasks}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
