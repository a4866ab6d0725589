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
