"""swe-lite's task generator: small Python repositories with one bug each, reproducible from a seed.

    python -m examples.swe_lite.generate --out runs/swe_lite/tasks --split train --count 2000 --seed 0

A repository is a package (`<package>/`) of 2-3 modules of 2 functions each (functions.py), with one
test file per module (`tests/test_<module>.py`, one test per call, its expected value computed from
the correct source). A task puts one bug (functions.FAMILIES) into one function: its FAIL_TO_PASS
tests are those the bug breaks, its PASS_TO_PASS tests all the others; both are computed by running
the tests in-process on the correct and the buggy source, so a task whose bug breaks nothing, or
breaks a test of another function, is never made.

Package and module names are made-up words drawn afresh for each repository from a space cut in two
by a hash (`draw_name`): the held-out splits' names never occur in training or the demonstrations,
so neither does a held-out task's repository, its files' paths or its problem statement (`overlap()`
checks what the model sees; tests/swe_lite/test_generate.py runs it). Two splits are held out: `val`,
on which settings are chosen, and `test`, which reports and is never used for choosing. The problem
statement gives a failing call and its wrong result but not the file. The demonstrations' easier case
adds a hint (HINTS): `path` names the bug's file (`The bug is in tota/nesodi.py.`), `module` its module
alone (`The bug is in nesodi.py.`), so the package has to come from the statement's first words, as on
every other task.
"""

from __future__ import annotations

import argparse
import json
import keyword
import random
import re
import sys
import zlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from examples.swe_lite.functions import FUNCTIONS, Bug, Function

SPLITS = ("train", "val", "test", "demo")
HINTS = ("none", "path", "module")  # what the statement says of the bug's file; `demo` defaults to DEMO_HINT
# The module alone: the package then comes from the statement's first words and the full path only from the agent's
# own `cat`, as on held-out tasks. Chosen on val: warm-start greedy 0.2344 -> 0.4062 (seed 0), 0.0156 -> 0.3125
# (seed 2) against `path` (examples/swe_lite/README.md, Measured)
DEMO_HINT = "module"
# Package and module names come from a large space of made-up words (2-3 syllables: about 350,000), drawn
# afresh for every repository, so a model cannot learn them by heart: it has to copy them from its context.
# The space is cut in two by a hash of the name: held-out names are never training's (or demonstrations').
# Held out are two splits: `val` for choosing settings (learning rate, recipe) and `test` for reporting, never
# used for choosing. They share the held-out half of the space but not repositories (other draws).
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
SYLLABLES = tuple(c + v for c in CONSONANTS for v in VOWELS)
NAME_BUCKETS = 8
BUCKETS = {"train": frozenset(range(1, NAME_BUCKETS)), "val": frozenset({0}), "test": frozenset({0})}
BUCKETS["demo"] = BUCKETS["train"]  # demonstrations: training's half of the space (other names each time)
# A split's seeds never meet another's. `val` keeps the salt of what was one `heldout` split before the test split.
SPLIT_SALT = {"train": 0, "val": 1_000_003, "test": 3_000_017, "demo": 2_000_029}
HELD_OUT = ("val", "test")
ASK = " Find the function, fix the bug, run the tests."  # every statement's last sentence
HINT_SENTENCE = re.compile(r" The bug is in [^ ]+\.py\.(?=" + re.escape(ASK) + r"$)")
RESERVED = frozenset(sys.stdlib_module_names) | frozenset(keyword.kwlist) | {"tests", "conftest"}


def without_hint(statement: str) -> str:
    """`statement` without the easier case's hint sentence: the statement a task of the same draw with hint
    `none` has. Raises ValueError when it has none."""
    bare, found = HINT_SENTENCE.subn("", statement)
    if not found:
        raise ValueError(f"without_hint: no hint sentence before the last sentence of {statement!r}")
    return bare


def name_bucket(name: str) -> int:
    return zlib.crc32(name.encode()) % NAME_BUCKETS


def draw_name(rng: random.Random, split: str, taken: Collection[str] = ()) -> str:
    """A made-up word of `split`'s half of the name space, not in `taken`, never a module Python has."""
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        if name_bucket(name) in BUCKETS[split] and name not in RESERVED and name not in taken:
            return name


class GenerationError(ValueError):
    pass


@dataclass(frozen=True)
class Module:
    name: str
    functions: tuple[tuple[Function, dict[str, int]], ...]  # each function with its drawn constants

    def source(self, bug: tuple[str, Bug] | None = None) -> str:
        parts = []
        for function, values in self.functions:
            text = render(function.source, values)
            if bug and bug[0] == function.name:
                correct, buggy = render(bug[1].correct, values), render(bug[1].buggy, values)
                if text.count(correct) != 1:
                    raise GenerationError(f"{function.name}: bug snippet {correct!r} is not unique")
                text = text.replace(correct, buggy)
            parts.append(text)
        return "\n\n".join(parts)


@dataclass(frozen=True)
class Case:
    test: str  # tests/test_<module>.py::test_<function>_<n>
    module: str
    function: str
    call: str  # e.g. "clamp(5, 0, 10)"
    expected: Any


@dataclass(frozen=True)
class Placement:
    """Where a task's bug sits: what the held-out split must never share with training."""

    package: str
    module: str
    function: str
    family: str
    buggy: str


def render(template: str, values: dict[str, int]) -> str:
    return template.format(**values, **{f"{k}_bad": v + 1 for k, v in values.items()})


def draw_repository(rng: random.Random, split: str) -> tuple[str, list[Module]]:
    package = draw_name(rng, split)
    names: list[str] = []
    for _ in range(rng.randint(2, 3)):
        names.append(draw_name(rng, split, {package, *names}))
    functions = rng.sample(FUNCTIONS, 2 * len(names))
    modules = []
    for i, name in enumerate(names):
        chosen = functions[2 * i : 2 * i + 2]
        modules.append(
            Module(name, tuple((f, {k: rng.choice(v) for k, v in f.constants.items()}) for f in chosen))
        )
    return package, modules


def cases(modules: Sequence[Module]) -> list[Case]:
    out = []
    for module in modules:
        namespace = run_source(module.source())
        for function, _ in module.functions:
            for n, args in enumerate(function.cases):
                call = f"{function.name}({', '.join(repr(a) for a in args)})"
                out.append(Case(f"tests/test_{module.name}.py::test_{function.name}_{n}", module.name,
                                function.name, call, eval(call, dict(namespace))))  # fmt: skip
    return out


def run_source(source: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<swe-lite>", "exec"), namespace)
    return namespace


def outcome(source: str, call: str) -> tuple[str, Any]:
    """('value', result) or ('raises', exception name) of `call` against `source`."""
    try:
        return "value", eval(call, run_source(source))
    except Exception as error:  # a bug may raise anything; the statement reports which
        return "raises", type(error).__name__


def test_module_source(package: str, module: str, module_cases: Iterable[Case]) -> str:
    lines = [f"from {package} import {module}\n"]
    for case in module_cases:
        name = case.test.split("::")[1]
        lines.append(f"\ndef {name}():\n    assert {module}.{case.call} == {case.expected!r}\n")
    return "".join(lines)


def make_task(rng: random.Random, split: str, index: int, hint: str) -> dict[str, Any] | None:
    """One task, or None when the drawn bug breaks no test or a test of another function."""
    package, modules = draw_repository(rng, split)
    module = rng.choice(modules)
    function, values = rng.choice(module.functions)
    bug = rng.choice(function.bugs)
    buggy_source = module.source((function.name, bug))
    all_cases = cases(modules)
    failing = [c for c in all_cases if c.module == module.name and outcome(buggy_source, c.call) != ("value", c.expected)]
    if not failing or any(c.function != function.name for c in failing):
        return None
    first = failing[0]
    kind, got = outcome(buggy_source, first.call)
    result = f"returns {got!r}" if kind == "value" else f"raises {got}"
    # The easier case adds one sentence to the same statement: a tiny model meets no other change of wording
    named = {"none": "", "path": f" The bug is in {package}/{module.name}.py.", "module": f" The bug is in {module.name}.py."}
    where = f"{named[hint]}{ASK}"
    files = {f"{package}/__init__.py": "", "pytest.ini": "[pytest]\naddopts = -p no:asyncio\n",
             "conftest.py": "# Makes the package at the repository root importable from tests/.\n"}  # fmt: skip
    for m in modules:
        files[f"{package}/{m.name}.py"] = buggy_source if m is module else m.source()
        files[f"tests/test_{m.name}.py"] = test_module_source(package, m.name, [c for c in all_cases if c.module == m.name])
    fixed, broken = render(bug.correct, values), render(bug.buggy, values)
    return {
        "id": f"{split}-{index:05d}",
        "problem_statement": f"In {package}, {first.call} {result} but it should return {first.expected!r}.{where}",
        "FAIL_TO_PASS": [c.test for c in failing],
        "PASS_TO_PASS": [c.test for c in all_cases if c not in failing],
        "files": files,
        "placement": asdict(Placement(package, module.name, function.name, bug.family, broken)),
        "fix": {"path": f"{package}/{module.name}.py", "buggy": broken, "correct": fixed},
    }


def generate(split: str, count: int, seed: int, hint: str | None = None) -> list[dict[str, Any]]:
    """`count` tasks of `split`, the same for the same seed. `hint` (HINTS) defaults to DEMO_HINT for `demo`,
    `none` for the others; it changes the statement only (the same draws, repositories and bugs)."""
    if split not in SPLITS:
        raise GenerationError(f"split {split!r}: expected one of {SPLITS}")
    if hint is None:
        hint = DEMO_HINT if split == "demo" else "none"
    if hint not in HINTS:
        raise GenerationError(f"hint {hint!r}: expected one of {HINTS}")
    rng = random.Random(seed * 7919 + SPLIT_SALT[split])
    tasks: list[dict[str, Any]] = []
    while len(tasks) < count:
        task = make_task(rng, split, len(tasks), hint)
        if task is not None:
            tasks.append(task)
    return tasks


def seen(task: dict[str, Any]) -> set[str]:
    """What the model sees of a task, as comparable keys: its statement, each file (path and text),
    where its bug sits, and its package's and modules' names."""
    placement = task["placement"]
    keys = {f"statement:{task['problem_statement']}", f"placement:{json.dumps(placement, sort_keys=True)}"}
    keys.update(f"name:{name}" for name in repository_names(task))
    keys.update(f"file:{path}:{text}" for path, text in task["files"].items() if text.strip() and "/" in path)
    return keys


def repository_names(task: dict[str, Any]) -> list[str]:
    """The task's package name and its modules' names."""
    package = task["placement"]["package"]
    modules = [Path(path).stem for path in task["files"] if path.startswith(f"{package}/")]
    return [package, *(name for name in modules if name != "__init__")]


def overlap(train: Iterable[dict[str, Any]], held_out: Iterable[dict[str, Any]]) -> list[str]:
    """Keys of what the model sees (seen()) that a held-out task shares with a training one."""
    train_keys: set[str] = set()
    for task in train:
        train_keys |= seen(task)
    return sorted({key for task in held_out for key in seen(task) & train_keys})


def write_tasks(tasks: Sequence[dict[str, Any]], out: str | Path) -> Path:
    """Each task's repository under `out/repos/<id>/`, and `out/tasks.jsonl` (examples/swe's fields,
    `repo` absolute; `files` stay out of the line, `placement` and `fix` stay in)."""
    out = Path(out).resolve()
    lines = []
    for task in tasks:
        repo = out / "repos" / task["id"]
        for path, text in task["files"].items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        lines.append(json.dumps({**{k: v for k, v in task.items() if k != "files"}, "repo": str(repo)}))
    (out / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    return out / "tasks.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.swe_lite.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for tasks.jsonl and repos/")
    parser.add_argument("--split", choices=SPLITS, default="train")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hint", choices=HINTS, default=None,
        help=f"what the statement says of the bug's file: path (the package and module), module (the module "
        f"alone) or none; default {DEMO_HINT} for --split demo (the easier case), none for the others. E.g. "
        f"--split val --hint path measures the easier case on held-out names",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    path = write_tasks(generate(args.split, args.count, args.seed, args.hint), args.out)
    print(f"swe-lite: {args.count} {args.split} tasks (seed {args.seed}) in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
