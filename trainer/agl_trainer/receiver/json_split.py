"""JSON text split into its parts without parsing them: the slow path of OTLP JSON decoding.

msgspec refuses a whole document for one string it cannot decode (a lone surrogate escape, which a
JavaScript harness writes when it cuts a message inside an emoji) or for nesting past its depth (a
few hundred levels), and so did the receiver: one record cost every record beside it. These
functions find where each value starts and ends, walking strings and brackets with a regular
expression and a stack (no recursion, no decoding), so that each record, and inside a record each
field and attribute, can be decoded on its own and fail on its own.

`items(body, names)` is an export request's records; `fields(text)` an object's members;
`elements(text)` an array's values. Each raises `DecodeError` naming the byte where the text is not
JSON's structure (an unclosed string or bracket, a bracket that does not match).
"""

from __future__ import annotations

import json
import re

from agl_trainer.receiver.raw_span import DecodeError

_WS = re.compile(rb"[ \t\r\n]*")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(rb"[^ \t\r\n,:\]}\[{\"]+")
_NESTING = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)  # what a bracket walk must see
_CLOSES = {ord("["): ord("]"), ord("{"): ord("}")}

Span = tuple[int, int]  # [start, end) in the text


def _skip(text: bytes, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


def _error(text: bytes, pos: int, what: str) -> DecodeError:
    return DecodeError(f"invalid OTLP JSON: {what} at byte {pos}")


def loads(data: bytes) -> object:
    """One JSON value by Python's json, which keeps a lone surrogate escape as it is (msgspec
    refuses it); bytes that are not UTF-8 become lone surrogates too. The contract refuses either
    where agl reads it. DecodeError when it is not JSON."""
    try:
        return json.loads(data.decode("utf-8", "surrogateescape"))
    except ValueError as error:
        raise DecodeError(f"invalid OTLP JSON: {error}") from None


def value_end(text: bytes, pos: int) -> int:
    """Where the JSON value starting at `pos` ends (nested brackets walked, strings skipped whole)."""
    if pos >= len(text):
        raise _error(text, pos, "a value expected")
    first = text[pos]
    if first == ord('"'):
        match = _STRING.match(text, pos)
        if match is None:
            raise _error(text, pos, "a string that does not end")
        return match.end()
    if first in _CLOSES:
        stack = [_CLOSES[first]]
        for match in _NESTING.finditer(text, pos + 1):
            token = match.group()
            if len(token) != 1:  # a string
                continue
            if token[0] in _CLOSES:
                stack.append(_CLOSES[token[0]])
            elif token[0] != stack.pop():
                raise _error(text, match.start(), "a bracket that does not match")
            elif not stack:
                return match.end()
        raise _error(text, len(text), "an object or array that does not end")
    match = _SCALAR.match(text, pos)
    if match is None:
        raise _error(text, pos, "a value expected")
    return match.end()


def fields(text: bytes, span: Span | None = None) -> list[tuple[str, Span]]:
    """The members of the object at `span` (the whole text by default): (name, where its value is).
    A name is decoded by Python's json, which keeps a lone surrogate (the contract then refuses it)."""
    start, end = span or (0, len(text))
    pos = _skip(text, start)
    if pos >= end or text[pos] != ord("{"):
        raise _error(text, pos, "an object expected")
    members: list[tuple[str, Span]] = []
    pos = _skip(text, pos + 1)
    if pos < end and text[pos] == ord("}"):
        return members
    while True:
        name = _STRING.match(text, pos)
        if name is None:
            raise _error(text, pos, "a member name expected")
        pos = _skip(text, name.end())
        if pos >= end or text[pos] != ord(":"):
            raise _error(text, pos, "':' expected")
        value_start = _skip(text, pos + 1)
        value_stop = value_end(text, value_start)
        members.append((str(loads(name.group())), (value_start, value_stop)))
        after = _next_item(text, value_stop, end, b"}")
        if after is None:
            return members
        pos = after


def elements(text: bytes, span: Span) -> list[Span]:
    """Where each value of the array at `span` is; an empty list for `null`."""
    start, end = span
    pos = _skip(text, start)
    if text.startswith(b"null", pos):
        return []
    if pos >= end or text[pos] != ord("["):
        raise _error(text, pos, "an array expected")
    values: list[Span] = []
    pos = _skip(text, pos + 1)
    if pos < end and text[pos] == ord("]"):
        return values
    while True:
        stop = value_end(text, pos)
        values.append((pos, stop))
        after = _next_item(text, stop, end, b"]")
        if after is None:
            return values
        pos = after


def _next_item(text: bytes, pos: int, end: int, close: bytes) -> int | None:
    """After a member or element: where the next one starts (past a ','), or None at `close`."""
    pos = _skip(text, pos)
    if pos < end and text[pos] == ord(","):
        return _skip(text, pos + 1)
    if pos < end and text[pos] == close[0]:
        return None
    raise _error(text, pos, f"',' or '{close.decode()}' expected")


def items(body: bytes, names: tuple[str, str, str]) -> list[bytes]:
    """The records of an export request, each as its own JSON text:
    {names[0]: [{names[1]: [{names[2]: [record, ...]}]}]}; other members are passed over."""
    records: list[bytes] = []
    for resource in _members_array(body, (0, len(body)), names[0]):
        for scope in _members_array(body, resource, names[1]):
            records += [body[start:stop] for start, stop in _members_array(body, scope, names[2])]
    if _skip(body, value_end(body, _skip(body, 0))) != len(body):
        raise _error(body, len(body), "text after the request")
    return records


def _members_array(text: bytes, span: Span, name: str) -> list[Span]:
    """The values of the array `name` of the object at `span` (none when it is absent or null)."""
    found: list[Span] = []
    for member, where in fields(text, span):
        if member == name:
            found = elements(text, where)
    return found
