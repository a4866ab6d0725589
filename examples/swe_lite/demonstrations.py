"""swe-lite's demonstrations: mini-swe-agent trajectories of a scripted policy, and their tokens.

    from examples.swe_lite.demonstrations import record, replies, training_tokens

    replies(task)                           # the scripted policy's replies: look, fix, test, submit
    replies(task, search=True)              # ... with `grep -rn "def f" .` first (never demonstrated)
    replies(task, tests_first=True)         # ... with the tests run first: their failure names the module
    replies(task, locate=True)              # ... naming the file by a search for its function: $(grep -rl "def f(" ...)
    record(task, "runs/swe_lite/demos")     # mini-swe-agent runs them: <id>.traj.json in its own format
    recorded(task, "runs/swe_lite/demos", tests_first=True)  # ... unless a whole one of that kind is there
    training_tokens(trajectory, tokenizer)  # (token ids, loss mask): the assistant turns to learn
    training_tokens(trajectory, tokenizer, observations=True)  # ... and the task and observations too
    training_tokens(hintless_opening(trajectory), tokenizer)  # its first reply, on the statement without the hint

`record` runs mini-swe-agent's DefaultAgent with its DeterministicModel (the replies in order) on a
fresh copy of the task's repo, through examples/swe's harness settings (agent.yaml, the same
environment, network off), so each observation is what the agent really saw. The replies need the
task's `fix` and `placement` (generate.py), which the agent never sees.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from examples.swe.harness import load_agent_config, make_environment
from examples.swe.swe_task import SUBMITTED, fresh_copy, parse_task

HERE = Path(__file__).resolve().parent
AGENT_CONFIG = HERE / "agent.yaml"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
RUN_TESTS = "python -m pytest -q tests"
SED_PATTERN_SPECIALS = "\\/.*[]^$"
SED_REPLACEMENT_SPECIALS = "\\/&"


def sed_escape(text: str, specials: str) -> str:
    return "".join(f"\\{c}" if c in specials else c for c in text)


def fix_expression(task: dict[str, Any]) -> str:
    """The `sed` expression that fixes `task`'s bug: its buggy snippet replaced by the correct one."""
    fix = task["fix"]
    return f"s/{sed_escape(fix['buggy'], SED_PATTERN_SPECIALS)}/{sed_escape(fix['correct'], SED_REPLACEMENT_SPECIALS)}/"


def found_by_search(function: str) -> str:
    """The file that defines `function`, named by a search instead of its path: a shell substitution the
    agent's `cat` and `sed` take as their file. It needs only the function's name (the statement's), not
    the made-up package and module names the path is made of (generate.py), which a tiny model copies a
    syllable at a time. (A repository's functions are distinct, and a test's `def test_f_0(` is no match.)"""
    return f"$(grep -rl \"def {function}(\" --include='*.py' .)"


def reply(thought: str, command: str) -> str:
    """A reply in mini-swe-agent's text-based format (mini_textbased.yaml's action block)."""
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def replies(
    task: dict[str, Any], *, search: bool = False, fix: bool = True, tests_first: bool = False, locate: bool = False
) -> list[str]:
    """The scripted policy for `task`: (search,) (test,) look, fix (unless `fix` is False), test, submit.

    `tests_first` runs the tests before looking: in the easier case the statement names the file (or its
    module) and the failing test (`tests/test_<module>.py`) names its module too, so a model that learns
    to read the file may copy the module from either; a task whose statement names none leaves it the test's.
    `locate` names the file in `cat` and `sed` by a search for the function (`found_by_search`) instead of its path:
    on the easier case both work; on a task whose statement names no file only the search needs no name copied."""
    path, function = task["fix"]["path"], task["placement"]["function"]
    buggy, correct = task["fix"]["buggy"], task["fix"]["correct"]
    target, looked = (found_by_search(function), f"the file that defines {function}") if locate else (path, path)
    steps = []
    if tests_first:
        steps.append(reply("Run the tests to see what fails.", RUN_TESTS))
    if search:
        steps.append(reply(f"Find where {function} is defined.", f'grep -rn "def {function}" .'))
    steps.append(reply(f"Read {looked}.", f"cat {target}"))
    if fix:
        steps.append(reply(f"{buggy} should be {correct}.", f"sed -i '{fix_expression(task)}' {target}"))
    steps.append(reply("Run the tests.", RUN_TESTS))
    steps.append(reply("Submit.", SUBMIT))
    return steps


def record(
    task: dict[str, Any], out_dir: str | Path, *, search: bool = False, tests_first: bool = False, locate: bool = False,
    network: str = "none",
) -> Path:  # fmt: skip
    """Run mini-swe-agent with the scripted replies on a fresh copy of the task's repo; save its
    trajectory (mini-swe-agent's `.traj.json`) to `out_dir/<task id>.traj.json` and return the path."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.test_models import DeterministicModel, make_output

    settings = load_agent_config(AGENT_CONFIG)
    model_settings = {k: v for k, v in (settings.get("model") or {}).items() if k == "observation_template"}
    outputs = [make_output(text, [{"command": text.split("```mswea_bash_command\n")[1][:-4]}], cost=0.0)
               for text in replies(task, search=search, tests_first=tests_first, locate=locate)]  # fmt: skip
    parsed = parse_task(task)
    with tempfile.TemporaryDirectory(prefix="swe-lite-demo-") as scratch:
        workspace = fresh_copy(parsed, Path(scratch) / "repo")
        agent = DefaultAgent(
            DeterministicModel(outputs=outputs, **model_settings),
            make_environment(settings, workspace, network),
            **{**settings["agent"], "step_limit": len(outputs) + 1, "cost_limit": 0},
        )
        agent.run(parsed.problem_statement)
        path = trajectory_path(task, out_dir)
        shown = {"search": search, "tests_first": tests_first, "locate": locate, "workspace": "<temporary>"}
        agent.save(path, {"info": {"swe_lite": shown}})
    return path


def trajectory_path(task: dict[str, Any], out_dir: str | Path) -> Path:
    """Where `record` saves `task`'s trajectory."""
    return Path(out_dir) / f"{task['id']}.traj.json"


def recorded(task: dict[str, Any], out_dir: str | Path, *, tests_first: bool, locate: bool = False) -> Path:
    """`task`'s demonstration: the trajectory already in `out_dir` when it is a whole one of the same
    kind (a rerun or a resumed `prepare` reuses it: recording is half of prepare's time), else recorded."""
    path = trajectory_path(task, out_dir)
    try:
        kept = load_trajectory(path)
    except (OSError, ValueError):  # absent, cut short by an interrupted run, or not a trajectory
        return record(task, out_dir, tests_first=tests_first, locate=locate)
    info = kept.get("info") or {}
    shown = info.get("swe_lite") or {}  # what `record` saved beside the run
    asked = next((m.get("content") for m in kept["messages"] if isinstance(m, dict) and m.get("role") == "user"), "")
    same_task = isinstance(asked, str) and task["problem_statement"] in asked  # not another seed's task of this id
    same_kind = shown.get("tests_first") == tests_first and bool(shown.get("locate")) == locate and not shown.get("search")
    if same_task and same_kind and info.get("exit_status") == SUBMITTED:
        return path
    return record(task, out_dir, tests_first=tests_first, locate=locate)


def load_trajectory(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    whole = isinstance(data, dict) and data.get("trajectory_format") == "mini-swe-agent-1.1"
    if not whole or not isinstance(data.get("messages"), list):
        raise ValueError(f"{path}: not a mini-swe-agent-1.1 trajectory (expected `trajectory_format` and `messages`)")
    return data


# What in a recorded observation depends on the machine rather than the task: pytest's wall time
# ("in 0.04s", longer under load) and CPython's object addresses in its assertion messages
# ("<function clamp at 0x7fe6ee2a8ea0>", ASLR). Two recordings of the same seed differed in 1975 of
# 2048 demonstrations, and so did the tokenizer trained on them and the warm start (README,
# "Reproducible warm starts"). Written as fixed strings in what the tokenizer and the warm start read.
# An address is hex digits before a repr's ">", whole or (where the observation's truncation cut it)
# the end of one; its digits become 0s, so the text keeps its length.
MACHINE_DEPENDENT = (
    (re.compile(r"\bin \d+\.\d+s\b"), lambda match: "in 0.01s"),
    (re.compile(r"(?:0x)?[0-9a-f]{6,}(?=>)"), lambda match: re.sub(r"[0-9a-f]", "0", match.group())),
)


def canonical_observation(text: str) -> str:
    for pattern, fixed in MACHINE_DEPENDENT:
        text = pattern.sub(fixed, text)
    return text


def chat_messages(trajectory: dict[str, Any]) -> list[dict[str, str]]:
    """The conversation the model saw: system, user and assistant turns (mini-swe-agent's `exit`
    record and each message's `extra` are not sent to the model), observations canonical (what
    depends on the machine written as fixed strings: MACHINE_DEPENDENT)."""
    return [
        {"role": m["role"], "content": canonical_observation(m["content"]) if m["role"] == "user" else m["content"]}
        for m in trajectory["messages"]
        if m["role"] in ("system", "user", "assistant")
    ]


def hintless_opening(trajectory: dict[str, Any]) -> dict[str, Any]:
    """The demonstration's first exchange on its statement without the hint sentence: the system prompt,
    the bare statement (what training and held-out tasks say) and the first reply, which runs the tests
    whatever the statement names (`tests_first`). A warm start that meets only hinted statements may not
    know how to begin on a bare one (seed 0's first reply was a lone fence); this shows it the same first
    step there and nothing after it: reading the module off the failure stays RL's to find."""
    from examples.swe_lite.generate import without_hint

    messages = chat_messages(trajectory)
    roles = [m["role"] for m in messages[:3]]
    if roles != ["system", "user", "assistant"]:
        raise ValueError(f"hintless_opening: expected system, user, assistant turns first, got {roles}")
    if RUN_TESTS not in messages[2]["content"]:
        raise ValueError("hintless_opening: the first reply does not run the tests (record with tests_first=True)")
    bare = {**messages[1], "content": without_hint(messages[1]["content"])}
    return {"messages": [messages[0], bare, messages[2]]}


def training_tokens(
    trajectory: dict[str, Any], tokenizer: Any, *, observations: bool = False
) -> tuple[list[int], list[int]]:
    """The conversation's token ids as the chat template renders it, and a mask of the assistant
    turns (content and end of turn): what a warm start learns. `observations`: the task and the
    observations too (every token after the system prompt), as language modelling: pytest's output
    repeats the task's names many times over, which is where a tiny model learns to copy a name from
    its context instead of recalling one."""
    messages = chat_messages(trajectory)

    def ids(upto: int, generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages[:upto], tokenize=True, add_generation_prompt=generation_prompt, return_dict=False))

    full = ids(len(messages), False)
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = len(ids(index, True)), len(ids(index + 1, False))
        if full[:end] != ids(index + 1, False) or full[end - 2] != tokenizer.eos_token_id:
            raise ValueError("training_tokens: the chat template's tokens of a prefix are not a prefix of the whole")
        mask[start : end - 1] = [1] * (end - 1 - start)  # the reply and its end of turn, not the newline after
    if observations:
        after_system = len(ids(1, False)) if messages and messages[0]["role"] == "system" else 1
        mask[after_system:] = [1] * (len(full) - after_system)
    return full, mask
