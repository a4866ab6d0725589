"""Where swe-lite rollouts fail: each rollout's commands, read back from a run's store, against the
stages of the fix its task needs (run the tests, read the right file, edit it, the fix, pass).

    python -m examples.swe_lite.stages runs/swe_lite/eval-warm-test runs/swe_lite/eval-trained-test \\
        --tasks runs/swe_lite/test/tasks.jsonl

A run directory is an `agl eval` or `agl train` output (its `rollouts.db`); `--tasks` the tasks its
rollouts ran (their `fix` and `placement`, which the agent never sees). Each run's completion tokens
are decoded with the tokenizer of the model it served (its `receipt.json`, else its `config.yaml`);
`--model` names one for runs that recorded none, and is refused for a run whose model's tokenizer
differs (prepare trains a vocabulary a seed: another seed's would decode other text). One column a
run, each stage counted over its rollouts:

- ran the tests: a command runs pytest
- found it by a search: a command names the file by a search for the bug's function,
  `$(grep ... "def f(" ...)` (demonstrations.found_by_search, any quoting); such a command counts as
  naming the file with the bug in the stages below, a search for another function as another file
- read the right file: `cat` of the file with the bug (`./` and spacing aside)
- read only other files: `cat` of some .py file, never the right one (a path copied wrong, mostly)
- read its package / read its module: `cat` of a .py file in the bug's package (the statement names
  it) / of the bug's module in any directory (the failing test names it): which half of the path a
  model copies right
- edited the right file: `sed -i` whose last argument is the file with the bug
- the demonstrated fix: the demonstrations' own `sed` for this bug (demonstrations.fix_expression), to the
  letter; another spelling that fixes the bug counts under passed only
- passed: the rollout's reward is 1.0 (the grader's FAIL_TO_PASS and PASS_TO_PASS tests pass)
- submitted / submitted, not passed: a command is the submit one (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`);
  a policy that submits only when it passed gives every token of that command a positive advantage
- submitted and passed: both, SWE-bench's "resolved" (the reward `grader.py --require-submission`
  gives; without it the grader scores the copy however the run ended)

and passed by bug family. Commands are parsed as the agent parses them (mini-swe-agent's text-based
action regex); a reply with no command counts for nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_integrations.mini_swe_agent import SidecarTextModelConfig

from examples.swe_lite.demonstrations import SUBMIT, fix_expression

ACTION = re.compile(SidecarTextModelConfig.model_fields["action_regex"].default, re.DOTALL)
STAGES = (
    ("tests", "ran the tests"),
    ("searched", "found it by a search"),
    ("read_right", "read the right file"),
    ("read_other_only", "read only other files"),
    ("read_package", "read its package"),
    ("read_module", "read its module"),
    ("edited_right", "edited the right file"),
    ("fix", "the demonstrated fix"),
    ("passed", "passed (reward 1.0)"),
    ("submitted", "submitted"),
    ("submitted_passed", "submitted and passed"),
    ("submitted_unpassed", "submitted, not passed"),
)


# A shell substitution naming a file by a search for a function's definition: `$(grep -rl "def f(" ...)`
SEARCH = re.compile(r"""\$\(\s*grep\s[^)]*?def(?:\\?\s)+(\w+)\\?\([^)]*\)""")


def commands(replies: Iterable[str]) -> list[str]:
    """The bash command of each reply that has exactly one (as mini-swe-agent runs them)."""
    found = []
    for reply in replies:
        actions = ACTION.findall(reply)
        if len(actions) == 1:
            found.append(actions[0].strip())
    return found


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unclosed quote: the agent's bash would refuse it too
        return []


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)


def stages(task: dict[str, Any], run: Sequence[str], reward: float | None) -> set[str]:
    """The stages (STAGES' keys) one rollout reached: `run` its commands, `reward` its final reward."""
    path, function = task["fix"]["path"], task["placement"]["function"]
    reached: set[str] = set()
    read: list[str] = []
    for command in run:
        searched = {match.group(1) for match in SEARCH.finditer(command)}
        if function in searched:
            reached.add("searched")
        # a search names the file that defines its function: the bug's file, or another one
        command = SEARCH.sub(lambda match: path if match.group(1) == function else "elsewhere/other.py", command)
        words = _words(command)
        if not words:
            continue
        if "pytest" in words:
            reached.add("tests")
        if words == SUBMIT.split():
            reached.add("submitted")
        if words[0] == "cat":
            read += [w for w in words[1:] if w.endswith(".py")]
        if words[0] == "sed" and "-i" in words and len(words) >= 4 and _same_path(words[-1], path):
            reached.add("edited_right")
            if fix_expression(task) in words[1:-1]:
                reached.add("fix")
    if any(_same_path(p, path) for p in read):
        reached.add("read_right")
    elif read:
        reached.add("read_other_only")
    package, module = os.path.split(os.path.normpath(path))
    if any(os.path.dirname(os.path.normpath(p)) == package for p in read):
        reached.add("read_package")
    if any(os.path.basename(p) == module for p in read):
        reached.add("read_module")
    if reward == 1.0:
        reached.add("passed")
        if "submitted" in reached:
            reached.add("submitted_passed")
    elif "submitted" in reached:
        reached.add("submitted_unpassed")
    return reached


@dataclass
class RunStages:
    """One run's counts: how many rollouts reached each stage, and passed / rollouts by bug family."""

    name: str
    rollouts: int = 0
    reached: Counter[str] = field(default_factory=Counter)
    family_passed: Counter[str] = field(default_factory=Counter)
    family_rollouts: Counter[str] = field(default_factory=Counter)

    def add(self, task: dict[str, Any], reached: set[str]) -> None:
        family = task["placement"]["family"]
        self.rollouts += 1
        self.reached.update(reached)
        self.family_rollouts[family] += 1
        self.family_passed[family] += "passed" in reached


def read_run(run_dir: Path, tasks: dict[str, dict[str, Any]], decode: Callable[[Sequence[int]], str]) -> RunStages:
    """Count the stages of every complete rollout in `run_dir`'s store (each one's task must be in `tasks`)."""
    from agl import semconv
    from agl_trainer.store import RolloutStore

    store_path = run_dir / "rollouts.db"
    counts = RunStages(run_dir.name)
    with RolloutStore(store_path) as store:
        infos = [info for info in store.rollouts() if info.complete]
        unknown = sorted({info.task_id for info in infos if info.task_id not in tasks}, key=str)
        if unknown:
            raise SystemExit(
                f"stages: {run_dir}'s rollouts ran tasks not in --tasks ({', '.join(map(str, unknown[:3]))}...)"
                " (fix: pass the tasks.jsonl the run was given)"
            )
        for info in infos:
            data = store.load(info.key)  # its calls and its rewards, in one read
            replies = [decode(call.completion_ids.tolist()) for call in data.calls if call.completion_ids is not None]
            task = tasks[info.task_id]
            counts.add(task, stages(task, commands(replies), data.final_reward(semconv.DEFAULT_REWARD_NAME)))
    return counts


def _is_task(task: Any) -> bool:
    """Whether `task` has what stages() reads (generate.py's fields the agent never sees)."""
    try:
        fix, placement = task["fix"], task["placement"]
        named = (task["id"], fix["path"], fix["buggy"], fix["correct"], placement["family"], placement["function"])
        return all(isinstance(v, str) for v in named)
    except (KeyError, TypeError):
        return False


def read_tasks(path: Path) -> dict[str, dict[str, Any]]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"stages: cannot read {path} as text ({error})") from None
    tasks = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except ValueError:
            task = None
        if not _is_task(task):
            raise SystemExit(f"stages: {path}:{number} is not a swe-lite task (fix: pass a tasks.jsonl from generate/prepare)")
        tasks[task["id"]] = task
    return tasks


def table(runs: Sequence[RunStages]) -> str:
    def cell(count: int, total: int) -> str:
        return f"{count} ({count / total:.0%})" if total else "0"

    rows = [("stage", *(run.name for run in runs)), ("rollouts", *(str(run.rollouts) for run in runs))]
    rows += [(label, *(cell(run.reached[key], run.rollouts) for run in runs)) for key, label in STAGES]
    families = sorted({family for run in runs for family in run.family_rollouts})
    rows += [(f"passed, {family}", *(f"{run.family_passed[family]}/{run.family_rollouts[family]}" for run in runs))
             for family in families]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip() for row in rows)


def served_model(run: Path) -> Path | None:
    """The model directory a run served, as agl recorded it beside the store: an eval's receipt.json (an
    absolute path), else the run's config.yaml (the viewer's `run_model`, which takes a relative path from
    the directory the run ran in); None if neither names one that is here."""
    from agl_trainer.eval.receipt import RECEIPT_FILE
    from agl_trainer.viewer.run_model import run_model

    try:
        path = json.loads((run / RECEIPT_FILE).read_text(encoding="utf-8"))["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # unreadable, not JSON, not a receipt, too deep
        path = None
    if isinstance(path, str) and Path(path).is_dir():
        return Path(path)
    model = run_model(run)
    return Path(model) if model is not None else None


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two model directories decode tokens alike: their tokenizer.json, byte for byte."""
    try:
        return a.resolve() == b.resolve() or (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    except OSError:
        return False


def column_names(runs: Sequence[Path]) -> list[str]:
    """Each run's directory name, with its parent's where two share one (two seeds' eval-warm-val)."""
    repeated = Counter(run.name for run in runs)
    return [f"{run.parent.name}/{run.name}" if repeated[run.name] > 1 else run.name for run in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.swe_lite.stages", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("runs", nargs="+", type=Path, help="`agl eval` / `agl train` output directories, one column each")
    parser.add_argument("--tasks", type=Path, required=True, help="the tasks.jsonl the runs ran")
    parser.add_argument(
        "--model", type=Path,
        help="a model directory whose tokenizer decodes the runs' tokens (default: each run's own, from its receipt.json "
        "or config.yaml); refused for a run that served a model with another tokenizer",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.tasks.is_file():
        parser.error(f"--tasks {args.tasks}: no such file")
    tasks = read_tasks(args.tasks)
    models: list[Path] = []
    for run in args.runs:
        if not (run / "rollouts.db").is_file():
            parser.error(f"{run} has no rollouts.db (fix: pass an `agl eval` or `agl train` output directory)")
        served = served_model(run)
        if args.model is not None and served is not None and not same_tokenizer(args.model, served):
            parser.error(
                f"{run} served {served}, whose tokenizer differs from --model {args.model}'s: its tokens would decode "
                "as other text (fix: leave --model out to decode each run with its own model)"
            )
        model = args.model if args.model is not None else served
        if model is None:
            parser.error(f"{run}: its receipt.json / config.yaml name no model directory found here (fix: pass --model, the model it served)")
        models.append(model)
    from transformers import AutoTokenizer

    decoders: dict[Path, Callable[[Sequence[int]], str]] = {}
    for model in dict.fromkeys(models):
        try:
            decoders[model] = AutoTokenizer.from_pretrained(model).decode
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"{model}: no tokenizer loads from it ({type(error).__name__}: {error}; fix: pass --model, the model directory the runs served)")
    columns = [read_run(run, tasks, decoders[model]) for run, model in zip(args.runs, models)]
    for column, name in zip(columns, column_names(args.runs)):
        column.name = name
    print(table(columns))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
