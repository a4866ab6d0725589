"""CONFIG and config overrides out of a command's arguments, with the command's own flags taken out
wherever they appear (`agl train CONFIG --loop.max_steps 5 --resume`): argparse would move unknown
flags away from their values, so the raw order is read here."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

# Called with (argument, the rest of the arguments, whether it is the value of the previous override):
# True when the argument was one of the command's own flags (its value taken from the rest if needed).
FlagHandler = Callable[[str, Iterator[str], bool], bool]


def split_arguments(
    args: argparse.Namespace, command: str, own_flag: FlagHandler
) -> tuple[str | None, list[str]]:
    """The config path (the first bare argument) and the overrides (`--key value`, `--key=value`)."""
    argv = list(getattr(args, "argv", []) or [])
    if command in argv:
        rest = argv[argv.index(command) + 1 :]
    else:
        rest = list(getattr(args, "args", []) or []) + list(getattr(args, "extra", []) or [])
    config: str | None = None
    overrides: list[str] = []
    expects_value = False
    items = iter(rest)
    for item in items:
        if own_flag(item, items, expects_value):
            pass
        elif config is None and not item.startswith("--") and not expects_value:
            config = item
        else:
            overrides.append(item)
            expects_value = item.startswith("--") and "=" not in item and not expects_value
            continue
        expects_value = False
    return config, overrides
