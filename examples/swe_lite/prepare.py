"""swe-lite's tasks, demonstrations and warm-started tiny model, built offline.

    python -m examples.swe_lite.prepare --out runs/swe_lite --seed 0

writes `train/tasks.jsonl` (2000 tasks, their repos in `train/repos/`), `val/tasks.jsonl` and
`test/tasks.jsonl` (64 tasks each of other repositories, names and bug placements: `val` to choose
settings on, `test` to report, never used for choosing), `demos/*.traj.json` (mini-swe-agent trajectories
of the scripted policy on the easier case: the statement names the bug's module (`--demo-hint`), so the
agent runs the tests, reads the file, fixes it, runs the tests and submits; a quarter of them name the
file by a search, `--locate-demos` below), `model-init/` (a tiny Llama with a BPE vocabulary trained on
the demonstrations and training repositories, 2048 positions: a rollout's conversation is 400-1500
tokens) and `model-warm/` (model-init after a supervised warm start on the demonstrations' assistant
turns, and on 256 of them their first reply again on the statement without the hint, as training and
held-out tasks say it): what `config.yaml` trains from.
The warm start is two cosine passes over the same examples: 2400 steps from 1e-3 (saved as
`model-warm-first/`), then 1200 from 3e-4 (`--continue-steps`; the first pass alone left the 3-layer
model undertrained: README, "The 3-layer warm starts trained longer").

    python -m examples.swe_lite.prepare --out runs/swe_lite --seed 0 --continue-from runs/swe_lite/model-warm-first

runs only the second pass, from an existing warm start, on the directory's recorded demonstrations.

    python -m examples.swe_lite.prepare --out runs/swe_lite --seed 0 --hintless-demos 256

records the last 256 demonstrations on their statement without the hint, as training and held-out tasks
say it: the module then comes only from the failing test's output, so that copy exists in the warm start
for RL to reinforce (default 0: every demonstration is the easier case).

    python -m examples.swe_lite.prepare --out runs/swe_lite --seed 0 --locate-demos 512

(the default) has the last 512 demonstrations name the file in `cat` and `sed` by a search for the
function the statement names (`$(grep -rl "def f(" --include='*.py' .)`) instead of its path: on the
easier case both work, so the warm start knows both; on training and held-out tasks only the search
needs no made-up name copied, and which of the two to prefer is left to RL (0: every demonstration
writes the path).

The training and held-out statements do not name the file: the module is in the failing test's
name (`FAILED tests/test_<module>.py::...`), which the demonstrations show but never need; reading
it from there (or searching) is what RL has to add to what the warm start shows. Every repository's
names are new (generate.py), so the warm start has to learn to copy them, not recall them.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from examples.demo.warmstart import SCHEDULES
from examples.swe_lite.generate import DEMO_HINT, HELD_OUT, HINTS, generate, without_hint, write_tasks

TRAIN_TASKS = 2000
HELD_OUT_TASKS = 64  # each of val and test
DEMOS = 2048  # many, each with new names: with 256 over 19 epochs the model made names up instead of copying
WARM_START_STEPS = 2400
WARM_START_THREADS = 2  # torch threads: 1.7x one thread's speed for this model on 2 cores
RECORD_WORKERS = 2  # demonstrations recorded in parallel (each is mini-swe-agent running four commands)
WARM_START_LR = 1e-3
WARM_START_BATCH = 8
WARM_START_SCHEDULE = "cosine"  # down to 0 at the last step (examples/demo/warmstart.py)
WARM_START_WARMUP = 100
CONTINUE_STEPS = 1200  # the second pass (0: none)
CONTINUE_LR = 3e-4  # from where the first pass's cosine ended (0), no warmup: a gentler second descent
OPENINGS = 256  # demonstrations whose first reply is also learned on the statement without the hint
HINTLESS_DEMOS = 0  # demonstrations (the last ones) recorded on the statement without the hint
# Demonstrations (the last ones) naming the file by a search for the function, not its path: a quarter. Chosen on
# val (seed 0, 2026-12-07): RL from that warm start went 0.1250 -> 0.7031 greedy in 30 minutes, where from the
# all-path warm start (0.2656) no setting gained (examples/swe_lite/README.md, "Two ways to name the file")
LOCATE_DEMOS = 512
VOCAB_SIZE = 1024
CORPUS_REPOS = 300  # training repositories the BPE vocabulary sees (never held-out ones)


@dataclass
class PreparedSweLite:
    model: Path
    train_tasks: Path
    held_out_tasks: dict[str, Path]  # split (val, test) -> its tasks.jsonl
    demos: list[Path]
    warm_start_seconds: float  # both passes
    final_loss: float


# 3: the 2-layer warm start copied the task's names on one seed of three (val greedy 0.0, 0.0, 0.42); 3 layers with
# the cosine rate and the openings: 0.08, 0.33, 0.45 (examples/swe_lite/README.md, "Warm starts that hold across seeds")
LAYERS = 3
HEADS = 2  # each head is tiny.HEAD_DIM (64) wide, so heads set the width


def model_spec(seed: int, *, layers: int = LAYERS, heads: int = HEADS):
    from agl_trainer.models.tiny import HEAD_DIM, TinyModelSpec

    return TinyModelSpec(
        hidden=HEAD_DIM * heads, layers=layers, heads=heads, kv_heads=heads, intermediate=256 * heads, max_positions=2048,
        seed=seed,
    )  # fmt: skip


def prepare_swe_lite(
    workdir: str | Path, *, seed: int = 0, demos: int = DEMOS, steps: int = WARM_START_STEPS,
    train: int = TRAIN_TASKS, held_out: int = HELD_OUT_TASKS, tests_first: bool = True, observations: bool = False,
    layers: int = LAYERS, heads: int = HEADS, demo_hint: str = DEMO_HINT, openings: int = OPENINGS,
    hintless: int = HINTLESS_DEMOS, located: int = LOCATE_DEMOS, schedule: str = WARM_START_SCHEDULE,
    continue_steps: int = CONTINUE_STEPS, progress: bool = False,
) -> PreparedSweLite:  # fmt: skip
    from agl_trainer.models.tiny import build_bpe_tokenizer, save_model
    from transformers import AutoTokenizer

    from examples.demo.warmstart import supervised_warm_start
    from examples.swe_lite.demonstrations import chat_messages, load_trajectory

    workdir = Path(workdir)
    train_rows = generate("train", train, seed)
    train_tasks = write_tasks(train_rows, workdir / "train")
    held_out_tasks = {split: write_tasks(generate(split, held_out, seed), workdir / split) for split in HELD_OUT}
    demo_tasks = write_tasks(hintless_tail(generate("demo", demos, seed, demo_hint), hintless), workdir / "demo")
    demo_rows = [json.loads(line) for line in demo_tasks.read_text().splitlines()]
    searching = searching_tail(len(demo_rows), located)
    with ProcessPoolExecutor(RECORD_WORKERS) as pool:
        record = partial(record_demonstration, out_dir=workdir / "demos", tests_first=tests_first)
        shown = list(pool.map(record, demo_rows, searching))
    trajectories = [load_trajectory(path) for path in shown]
    corpus = ["\n".join(m["content"] for m in chat_messages(t)) for t in trajectories]
    corpus += ["\n".join([t["problem_statement"], *t["files"].values()]) for t in train_rows[:CORPUS_REPOS]]
    tokenizer = build_bpe_tokenizer(corpus, VOCAB_SIZE)
    initial = save_model(workdir / "model-init", tokenizer, model_spec(seed, layers=layers, heads=heads), {"tokenizer": "byte-level-bpe"})
    tokenizer = AutoTokenizer.from_pretrained(initial)  # as the engine loads it
    examples = warm_start_examples(trajectories, tokenizer, openings if tests_first else 0, observations=observations)
    first = warm_start_pass(steps, seed, WARM_START_LR, schedule=schedule, warmup_steps=min(WARM_START_WARMUP, steps - 1))
    result = supervised_warm_start(
        initial, workdir / ("model-warm-first" if continue_steps else "model-warm"), examples, first, progress=progress
    )
    seconds = result.seconds
    if continue_steps:
        second = warm_start_pass(continue_steps, seed, CONTINUE_LR)
        result = supervised_warm_start(result.path, workdir / "model-warm", examples, second, progress=progress)
        seconds += result.seconds
    return PreparedSweLite(result.path, train_tasks, held_out_tasks, shown, seconds, result.losses[-1])


def record_demonstration(row: dict, locate: bool, *, out_dir: Path, tests_first: bool) -> Path:
    """One demonstration (recorded, or reused when a whole one of its kind is there): a worker's job."""
    from examples.swe_lite.demonstrations import recorded

    return recorded(row, out_dir, tests_first=tests_first, locate=locate)


def last_ones(total: int, count: int, what: str) -> list[bool]:
    """Which of `total` demonstrations are the last `count` (`what` names them in the error when `count` is
    out of range): demonstrations said or done another way are the last ones, so the first `openings` stay
    the easier case's."""
    if not 0 <= count <= total:
        raise ValueError(f"{what}: {count} of {total}")
    return [index >= total - count for index in range(total)]


def searching_tail(total: int, count: int) -> list[bool]:
    """Which of `total` demonstrations name the file by a search (`--locate-demos`): the last `count` (an
    opening is only the tests' run, the same either way)."""
    return last_ones(total, count, "demonstrations that name the file by a search")


def hintless_tail(rows: list[dict], count: int) -> list[dict]:
    """`rows` with the last `count` statements said without the hint sentence, as training and held-out
    tasks say them (the same repositories and bugs); the others keep theirs. The last ones, so the first
    `openings` (whose hintless first reply is learned too) keep their hint."""
    hintless = last_ones(len(rows), count, "hintless demonstrations")
    return [{**row, "problem_statement": without_hint(row["problem_statement"])} if bare else row
            for row, bare in zip(rows, hintless)]  # fmt: skip


def warm_start_examples(trajectories: list[dict], tokenizer, openings: int, *, observations: bool = False) -> list:
    """What the warm start learns: every demonstration's replies (and observations, when asked), and the
    first `openings` demonstrations' first reply again on the statement without the hint (an opening is
    the tests' run, so only tests-first demonstrations have one)."""
    from examples.demo.warmstart import Demonstration
    from examples.swe_lite.demonstrations import hintless_opening, training_tokens

    examples = [Demonstration(*training_tokens(t, tokenizer, observations=observations)) for t in trajectories]
    return examples + [Demonstration(*training_tokens(hintless_opening(t), tokenizer)) for t in trajectories[:openings]]


def warm_start_pass(steps: int, seed: int, lr: float, *, schedule: str = "cosine", warmup_steps: int = 0):
    """One pass's schedule with prepare's batch and threads: by default (the second pass's) a cosine from
    `lr` down to 0, no warmup."""
    from examples.demo.warmstart import WarmStartConfig

    return WarmStartConfig(
        steps=steps, lr=lr, batch_size=WARM_START_BATCH, seed=seed, torch_threads=WARM_START_THREADS,
        schedule=schedule, warmup_steps=warmup_steps,
    )  # fmt: skip


def continue_warm_start(
    workdir: str | Path, start: str | Path, out: str | Path, *, seed: int = 0, steps: int = CONTINUE_STEPS,
    lr: float = CONTINUE_LR, openings: int = OPENINGS, observations: bool = False, progress: bool = False,
):  # fmt: skip
    """The second pass alone: `start` (a warm start of `workdir`'s tokenizer) trained `steps` more on the
    demonstrations `prepare` recorded in `workdir` (in their tasks' order, as prepare reads them), saved to `out`."""
    from transformers import AutoTokenizer

    from examples.demo.warmstart import supervised_warm_start
    from examples.swe_lite.demonstrations import load_trajectory, trajectory_path

    workdir, start, out = Path(workdir), Path(start), Path(out)
    if start.resolve() == out.resolve():
        raise ValueError(f"the continued warm start would overwrite its start {start}: name another --continue-to")
    tasks = workdir / "demo" / "tasks.jsonl"
    if not tasks.is_file():
        raise FileNotFoundError(f"{tasks} is missing: run `python -m examples.swe_lite.prepare --out {workdir}` first")
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    trajectories = [load_trajectory(trajectory_path(row, workdir / "demos")) for row in rows]
    if not 0 <= openings <= len(trajectories):
        raise ValueError(f"openings must be between 0 and the {len(trajectories)} demonstrations, got {openings}")
    examples = warm_start_examples(trajectories, AutoTokenizer.from_pretrained(start), openings, observations=observations)
    return supervised_warm_start(start, out, examples, warm_start_pass(steps, seed, lr), progress=progress)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m examples.swe_lite.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/swe_lite"), help="directory for the tasks, demos/, model-init/, model-warm/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WARM_START_STEPS, help="the warm start's first pass's steps")
    parser.add_argument("--demos", type=int, default=DEMOS, help="demonstrations (the easier case) to record")
    parser.add_argument(
        "--tests-first", action=argparse.BooleanOptionalAction, default=True,
        help="demonstrations run the tests before reading the file (their failure names the module: a bridge to "
        "tasks whose statement names no file; default on)",
    )  # fmt: skip
    parser.add_argument(
        "--observations", action=argparse.BooleanOptionalAction, default=False,
        help="the warm start also learns the task and the observations (language modelling), not only the "
        "replies; default off: measured worse (README, Measured)",
    )  # fmt: skip
    parser.add_argument(
        "--demo-hint", choices=[h for h in HINTS if h != "none"], default=DEMO_HINT,
        help=f"what the demonstrations' statements name: path (the bug's file) or module (its module alone, the "
        f"package left to copy from the statement's first words); default {DEMO_HINT}",
    )  # fmt: skip
    parser.add_argument(
        "--openings", type=int, default=OPENINGS,
        help=f"demonstrations whose first reply (running the tests) the warm start also learns on the statement "
        f"without the hint, as training and held-out tasks say it (default {OPENINGS}; 0: none; only with --tests-first, "
        "whose first reply that is)",
    )  # fmt: skip
    parser.add_argument(
        "--hintless-demos", type=int, default=HINTLESS_DEMOS,
        help="demonstrations (the last ones) recorded on the statement without the hint, as training and "
        "held-out tasks say it, so the module comes from the failing test's output alone (default "
        f"{HINTLESS_DEMOS}; at most --demos less --openings)",
    )  # fmt: skip
    parser.add_argument(
        "--locate-demos", type=int, default=LOCATE_DEMOS,
        help="demonstrations (the last ones) that name the file in `cat` and `sed` by a search for the function "
        "the statement names, $(grep -rl \"def f(\" --include='*.py' .), instead of writing its path: a way "
        "that needs no made-up name copied, shown on the easier case, for RL to prefer where the statement names "
        f"no file (default {LOCATE_DEMOS}; at most --demos)",
    )  # fmt: skip
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default=WARM_START_SCHEDULE,
        help=f"the warm start's first pass's learning rate: constant, or cosine down to 0 at the last step after "
        f"{WARM_START_WARMUP} warmup steps (default {WARM_START_SCHEDULE})",
    )  # fmt: skip
    parser.add_argument(
        "--continue-steps", type=int, default=CONTINUE_STEPS,
        help=f"the warm start's second pass: steps of a cosine from {CONTINUE_LR:g} down to 0 on the same examples, "
        f"after the first pass's --steps (default {CONTINUE_STEPS}; 0: one pass, saved as model-warm/)",
    )  # fmt: skip
    parser.add_argument(
        "--continue-from", type=Path, metavar="MODEL_DIR",
        help="run only the second pass, from this warm start, on --out's recorded demonstrations (no tasks, "
        "recording or tokenizer made again); writes --continue-to",
    )  # fmt: skip
    parser.add_argument(
        "--continue-to", type=Path, metavar="MODEL_DIR",
        help="where --continue-from's continued warm start goes (default: --out/model-warm)",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"the tiny model's layers (default {LAYERS})")
    parser.add_argument(
        "--heads", type=int, default=HEADS,
        help=f"its attention heads (default {HEADS}); each is 64 wide, so this sets the model's width (64 x heads) too",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("layers", "heads"):
        if not 1 <= getattr(args, name) <= 32:
            parser.error(f"--{name} must be between 1 and 32, got {getattr(args, name)}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.demos < 1:
        parser.error(f"--demos must be >= 1, got {args.demos}")
    if not 0 <= args.openings <= args.demos:
        parser.error(f"--openings must be between 0 and --demos ({args.demos}), got {args.openings}")
    if not 0 <= args.hintless_demos <= args.demos - args.openings:
        parser.error(
            f"--hintless-demos must be between 0 and --demos less --openings ({args.demos - args.openings}), got "
            f"{args.hintless_demos} (an opening is a hinted demonstration's first reply said again without the hint)"
        )
    if args.hintless_demos and not args.tests_first:
        parser.error(
            "--hintless-demos needs --tests-first: a demonstration whose statement names no file reads the module off "
            "the failing tests' output, so it runs them first (drop --no-tests-first)"
        )
    if not 0 <= args.locate_demos <= args.demos:
        parser.error(f"--locate-demos must be between 0 and --demos ({args.demos}), got {args.locate_demos}")
    if args.continue_steps < (1 if args.continue_from else 0):
        parser.error(f"--continue-steps must be >= {1 if args.continue_from else 0}, got {args.continue_steps}")
    if args.continue_to and not args.continue_from:
        parser.error("--continue-to names where --continue-from's result goes: give --continue-from too")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.continue_from:
        return continue_from(parser, args)
    prepared = prepare_swe_lite(
        args.out, seed=args.seed, steps=args.steps, demos=args.demos, tests_first=args.tests_first,
        observations=args.observations, layers=args.layers, heads=args.heads, demo_hint=args.demo_hint,
        openings=args.openings, hintless=args.hintless_demos, located=args.locate_demos, schedule=args.schedule,
        continue_steps=args.continue_steps, progress=True,
    )
    print(
        f"swe-lite: {len(prepared.demos)} demonstrations; warm start {prepared.warm_start_seconds:.1f} s, final loss "
        f"{prepared.final_loss:.3f}; wrote {prepared.model}, {prepared.train_tasks}, "
        + ", ".join(str(path) for path in prepared.held_out_tasks.values())
    )
    return 0


def continue_from(parser, args) -> int:
    """`--continue-from`: the second pass alone, its inputs checked before minutes of training."""
    if not (args.continue_from / "config.json").is_file():
        parser.error(f"--continue-from {args.continue_from}: not a saved model (no config.json there)")
    out = args.continue_to or args.out / "model-warm"
    try:
        result = continue_warm_start(
            args.out, args.continue_from, out, seed=args.seed, steps=args.continue_steps,
            openings=args.openings if args.tests_first else 0,
            observations=args.observations, progress=True,
        )  # fmt: skip
    except (OSError, ValueError) as error:  # a missing or broken demonstration, the start overwritten
        parser.error(f"--continue-from: {error}")
    print(f"swe-lite: continued {args.continue_from} {args.continue_steps} steps in {result.seconds:.1f} s, final loss "
          f"{result.losses[-1]:.3f}, mean of the last 100 {sum(result.losses[-100:]) / len(result.losses[-100:]):.3f}; wrote {result.path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
