"""`agl harness check -- COMMAND ...`: will a harness work through agl? And `agl harness table`."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from agl_trainer.cli import CLIError
from agl_trainer.console import make_console

CHECK_DESCRIPTION = """\
Will your harness work through agl? This runs COMMAND once, the way `agl train` runs a harness for
a rollout, against a fresh agl sidecar in front of a scripted engine (no model, no GPU), with a
receiver and a store in a temporary folder. Then it prints, for each request the harness made: the
API and path, the HTTP status the harness got, the model it asked for, prompt and completion
tokens, what agl recorded (the engine's token IDs, logprobs, the policy version, an agent or a
compaction the harness declared), the request's fields the sidecar dropped or passed on without
reading them (docs/protocols.md), and the body of any refusal; and whether the calls merge into
one training sample, each merge break classified as `agl traces inspect` does.

The harness's environment, as runners give it (runners/base.Endpoint):
  OPENAI_BASE_URL      http://127.0.0.1:PORT/rollouts/ID/v1   (OpenAI SDKs and most harnesses)
  ANTHROPIC_BASE_URL   http://127.0.0.1:PORT/rollouts/ID      (the Anthropic SDK, Claude Code)
  OPENAI_API_KEY, ANTHROPIC_API_KEY                           a placeholder
  AGL_ROLLOUT_ID, AGL_TASK_ID, AGL_ATTEMPT, AGL_ROLLOUT_MODE, AGL_TASK (the task as JSON: --task)
  AGL_OTLP_ENDPOINT    where the harness's own spans go (agl.init(), agl.emit_reward())
A harness that takes its endpoint from another variable gets it with --env NAME=VALUE (or
harness.env in --config); one that reads a file or a flag, through `sh -c` and $OPENAI_BASE_URL:
  agl harness check -- sh -c 'codex exec -c model_providers.agl.base_url="$OPENAI_BASE_URL" hi'

The scripted engine answers each call with a short text, or with --script FILE the file's turns in
the order the calls arrive (then the short text again), e.g. a tool call and then an answer:
  turns:
    - tool_calls: [{name: Bash, arguments: {command: "echo hello"}}]
    - content: "It printed hello."
A turn may also hold `reasoning` (thinking before its content), or be a plain string. The engine
speaks vLLM's API with token IDs and logprobs, serves any model name, tokenizes by bytes with a
ChatML template (tools in the system turn, tool calls as <tool_call> blocks).

Exit status: 0 when the harness exited 0 after at least one model call, every request was answered
below 400 and every model call was recorded with the engine's token IDs (merge breaks are reported,
not failed on); 1 otherwise, the last line saying why; 2 for a usage error.

examples:
  agl harness check -- python my_agent.py "add 2 and 3"
  agl harness check --script tool_then_answer.yaml --env HOME=/tmp/scratch \\
      -- claude -p "list the files" --allowedTools Bash
  agl harness check --config config.yaml        (harness.command, .env, .cwd, .timeout_s; the first task)
  agl harness check --json --name "my agent" --harness-version 1.2 -- python my_agent.py > my_agent.json
  agl harness table *.json                       (docs/protocols.md's compatibility table, in Markdown)
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "harness",
        help="check that a harness works through agl (agl harness check -- COMMAND ...)",
        description="Try a harness against agl before training with it.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="run a harness once against a sidecar and a scripted engine; say what was recorded",
        description=CHECK_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="agl harness check [options] -- COMMAND [ARG ...]",
    )
    check.add_argument("--script", type=Path, metavar="FILE", help="the scripted engine's turns (YAML or JSON)")
    check.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="a variable for the harness (repeat; wins over the runner's)")  # fmt: skip
    check.add_argument("--config", metavar="FILE",
                       help="an `agl train` config: its harness.command (when no COMMAND is given), harness.env,"
                       " harness.cwd, harness.timeout_s and its first task")  # fmt: skip
    check.add_argument("--task", metavar="JSON", help="the task the harness gets as AGL_TASK (default {})")
    check.add_argument("--cwd", metavar="DIR", help="the harness's working directory (default: this one)")
    check.add_argument("--timeout-s", type=float, default=None, metavar="S",
                       help="kill the harness (its process group) after S seconds (default 300)")  # fmt: skip
    check.add_argument("--name", help="the harness's name in the report and the table (default: the program)")
    check.add_argument("--harness-version", metavar="TEXT", help="the harness's version, for the table")
    check.add_argument("--keep", type=Path, metavar="DIR",
                       help="keep the store and the logs in DIR (then: agl traces serve --store DIR/rollouts.db)")  # fmt: skip
    check.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")
    check.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]",
                       help="the harness's command line, after --")  # fmt: skip
    check.set_defaults(run=run_check)

    table = commands.add_parser(
        "table",
        help="the compatibility table (Markdown) from reports saved with `agl harness check --json`",
        description="Print docs/protocols.md's compatibility table from `agl harness check --json` reports,"
        " one row per report, in the order given (scripts/compat_table.sh makes them).",
    )
    table.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json")
    table.set_defaults(run=run_table)
    parser.set_defaults(run=lambda args: (parser.print_help(), 2)[1])


def _options(args: argparse.Namespace) -> Any:
    from agl_trainer.harness_check.check import CheckOptions
    from agl_trainer.harness_check.script import ScriptError, load_script

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    env: dict[str, str] = {}
    task: dict[str, Any] = {}
    cwd, timeout_s = args.cwd, args.timeout_s
    if args.config:
        from agl_trainer.config import ConfigError, harness_argv, load_config, read_tasks

        try:
            config = load_config(args.config, check_paths=False)
            if not command and config.harness.command is not None:
                command = harness_argv(config.harness.command)
            tasks = read_tasks(config.tasks) if config.tasks and Path(config.tasks).is_file() else []
        except ConfigError as error:
            raise CLIError(f"--config {args.config}: {error}") from None
        env.update(config.harness.env)
        cwd = cwd or config.harness.cwd
        timeout_s = timeout_s if timeout_s is not None else config.harness.timeout_s
        task = tasks[0] if tasks else {}
    if not command:
        raise CLIError("no harness command (fix: agl harness check [options] -- COMMAND [ARG ...], or --config "
                       "with harness.command)")  # fmt: skip
    program = Path(cwd or ".") / command[0] if "/" in command[0] else None
    if program is not None and not program.exists() or program is None and shutil.which(command[0]) is None:
        raise CLIError(f"cannot run {command[0]!r}: no such program (fix: its path, or a program on PATH, after --)")
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CLIError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    if args.task is not None:
        try:
            task = json.loads(args.task)
        except ValueError as error:
            raise CLIError(f"--task: not JSON ({error})") from None
        if not isinstance(task, dict):
            raise CLIError("--task: a task is a JSON object, e.g. '{\"id\": \"t1\", \"question\": \"...\"}'")
    timeout_s = 300.0 if timeout_s is None else timeout_s
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= 86_400):
        raise CLIError(f"--timeout-s {timeout_s}: expected seconds, > 0 and at most 86400")
    if cwd is not None and not Path(cwd).is_dir():
        raise CLIError(f"--cwd {cwd}: no such directory")
    try:
        script = load_script(args.script) if args.script is not None else None
    except ScriptError as error:
        raise CLIError(str(error)) from None
    return CheckOptions(command=command, env=env, cwd=cwd, timeout_s=timeout_s, script=script, task=task,
                        name=args.name, version=args.harness_version, keep=args.keep)  # fmt: skip


def run_check(args: argparse.Namespace) -> int:
    from agl_trainer.harness_check.check import run_check as check
    from agl_trainer.harness_check.render import render
    from agl_trainer.harness_check.report import to_json
    from agl_trainer.loop.ports import SidecarError
    from agl_trainer.printable import plain
    from agl_trainer.runners.base import HarnessNotFound

    options = _options(args)
    progress = make_console(stderr=True)
    try:
        report = check(options, say=lambda line: progress.print(plain(f"agl harness check: {line}", style="dim")))
    except HarnessNotFound as error:
        raise CLIError(str(error).replace("harness.command", "the command after --")) from None
    except SidecarError as error:
        raise CLIError(f"{error} (the check could not start its sidecar)") from None
    if args.json:
        sys.stdout.buffer.write(to_json(report) + b"\n")
        sys.stdout.flush()
    else:
        render(make_console(), report)
    return 0 if report.ok else 1


def run_table(args: argparse.Namespace) -> int:
    import msgspec

    from agl_trainer.harness_check.render import TABLE_HEAD, table_row
    from agl_trainer.harness_check.report import from_json

    rows = []
    for path in args.reports:
        try:
            rows.append(table_row(from_json(path.read_bytes())))
        except OSError as error:
            raise CLIError(f"{path}: cannot read it ({error.strerror or error})") from None
        except msgspec.MsgspecError as error:
            raise CLIError(f"{path}: not a report of `agl harness check --json` ({error})") from None
    print(TABLE_HEAD)
    print("\n".join(rows))
    return 0
