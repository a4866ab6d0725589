"""Write the demo's tasks as JSONL: `python -m examples.demo.tasks --n 64 --seed 0 --out tasks.jsonl`
(`--split val` or `--split test`: held-out tasks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from examples.demo.task import SPLITS, write_tasks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo.tasks",
        description="Write seeded demo tasks (a key and a per-task table of values) as JSONL.",
    )
    parser.add_argument("--n", type=int, default=256, help="number of tasks (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="random seed: same seed, same tasks")
    parser.add_argument(
        "--split", default="train", choices=SPLITS,
        help="train (default), or a held-out split whose (key, value) pairs no training task holds: "
        "val (for choosing settings) or test (for reporting)",
    )  # fmt: skip
    parser.add_argument("--out", default="-", help="output path, or - for stdout (default)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    if args.out == "-":
        import json

        from examples.demo.task import make_tasks

        for task in make_tasks(args.n, args.seed, args.split):
            sys.stdout.write(json.dumps(task) + "\n")
        return 0
    path = write_tasks(args.out, args.n, args.seed, args.split)
    print(f"wrote {args.n} tasks to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
