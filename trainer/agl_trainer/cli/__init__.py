"""`agl`: the trainer's command line. Each subcommand lives in its own module of this package.

A subcommand module exposes `register(subparsers) -> None` (adds its parser, with
`set_defaults(run=...)` where `run(args) -> int` is the exit code). Modules are imported only
to build the parser, and heavy imports (torch, verl) happen inside `run`, so `agl --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from agl_trainer.redaction import redact_text

# Subcommand modules, in the order `agl --help` lists them.
SUBCOMMANDS: tuple[str, ...] = ("train", "eval", "export", "receive", "traces", "harness", "demo")


class CLIError(Exception):
    """A user error: printed as `agl: error: <message>` with exit code 2, never a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agl",
        description="Train an agent with RL inside the harness it already runs in.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"agl_trainer.cli.{name}")
        except ModuleNotFoundError as error:
            if error.name == f"agl_trainer.cli.{name}":
                continue  # not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # A subcommand that sets `_accepts_extra` (e.g. `agl train`, whose config keys are flags) gets
    # the arguments argparse does not know in `args.extra`; any other subcommand rejects them.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    args.argv = list(sys.argv[1:] if argv is None else argv)  # in order, for subcommands that need it
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except CLIError as error:
        print(f"agl: error: {redact_text(str(error))}", file=sys.stderr)  # a URL's password never printed
        return 2
    except KeyboardInterrupt:
        print("agl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
