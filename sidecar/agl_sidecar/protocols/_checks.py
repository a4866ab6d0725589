"""Checking a protocol request against its msgspec Structs: a ProtocolError (400) that names the
field (`param`, as OpenAI's errors do: `messages[0].content[1].id`), never a silent rewrite."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from agl_sidecar.protocols.base import ProtocolError

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_NAMED = re.compile(r"^Object (?:contains unknown|missing required) field `(?P<field>[^`]*)`")


def check(value: Any, struct: type[msgspec.Struct], at: str = "") -> Any:
    """`value` converted to `struct`, or ProtocolError(400) naming the field (`at`: the path of
    `value` in the request, e.g. `input[2]`)."""
    try:
        return msgspec.convert(value, struct)
    except msgspec.ValidationError as exc:
        raise invalid(str(exc), at) from None


def invalid(text: str, at: str = "") -> ProtocolError:
    """The ProtocolError for msgspec's message `text` about a value found at `at`."""
    where = _AT.search(text)
    reason = text[: where.start()] if where else text
    path = (at + where.group("path")) if where else at
    named = _NAMED.match(reason)
    if named:
        path = f"{path}.{named.group('field')}" if path else named.group("field")
    param = path.lstrip(".") or None
    shown = f"$.{param}".replace("$.[", "$[") if param else "$"
    return ProtocolError(400, f"invalid request: {reason} - at `{shown}`", param=param)


def refuse(message: str, param: str) -> ProtocolError:
    """A 400 for the field `param` that no Struct can express (`message` says why)."""
    return ProtocolError(400, f"invalid request: {message} - at `$.{param}`", param=param)


def unknown_keys(value: dict[str, Any], struct: type[msgspec.Struct], also: tuple[str, ...] = ()) -> list[str]:
    """The keys of `value` that are neither fields of `struct` (by their wire names) nor in `also`."""
    known = wire_names(struct)
    return [key for key in value if key not in known and key not in also]


def wire_names(struct: type[msgspec.Struct]) -> frozenset[str]:
    """The names `struct`'s fields have on the wire."""
    names = _WIRE_NAMES.get(struct)
    if names is None:
        names = _WIRE_NAMES[struct] = frozenset(f.encode_name for f in msgspec.structs.fields(struct))
    return names


_WIRE_NAMES: dict[type, frozenset[str]] = {}
_INDEX = re.compile(r"\[(\d+)\]")


class FieldFates:
    """What became of the parts of a request an adapter does not translate (base.Translation's
    `dropped` and `passed`): each entry "<JSON path>: <why>". An index becomes `[*]` where every item
    of its array (of two or more) shares the fate (`sized` tells the length), so the entries stay few."""

    def __init__(self) -> None:
        self._dropped: dict[tuple[str, str], None] = {}
        self._passed: dict[tuple[str, str], None] = {}
        self._sizes: dict[str, int] = {}

    def sized(self, path: str, length: int) -> None:
        """The array at `path` holds `length` items."""
        self._sizes[path] = length

    def drop(self, path: str, why: str) -> None:
        self._dropped[(path, why)] = None

    def pass_on(self, path: str, why: str) -> None:
        self._passed[(path, why)] = None

    def dropped(self) -> tuple[str, ...]:
        return self._collapsed(self._dropped)

    def passed(self) -> tuple[str, ...]:
        return self._collapsed(self._passed)

    def _collapsed(self, found: dict[tuple[str, str], None]) -> tuple[str, ...]:
        entries = list(found)
        while True:
            merged = self._merge_once(entries)
            if merged is None:
                return tuple(f"{path}: {why}" for path, why in entries)
            entries = merged

    def _merge_once(self, entries: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
        """One `[n]` -> `[*]` where the entries hold every index of that array, or None: the innermost
        index of each path first, so `a[0].b[0]`, `a[0].b[1]`, `a[1].b[0]` end as `a[*].b[*]`."""
        groups: dict[tuple[str, str, str], set[int]] = {}
        for path, why in entries:
            *_, match = [None, *_INDEX.finditer(path)]
            if match is not None:
                array, rest = path[: match.start()], path[match.end() :]
                groups.setdefault((array, rest, why), set()).add(int(match.group(1)))
        for (array, rest, why), indices in groups.items():
            size = self._sizes.get(array)
            if size and size > 1 and len(indices) == size and indices == set(range(size)):
                gone = {(f"{array}[{i}]{rest}", why) for i in indices}
                kept = [entry for entry in entries if entry not in gone]
                return [*kept, (f"{array}[*]{rest}", why)]
        return None
