"""The C encoder of token arrays (agl_sidecar._token_elements): built by the package's install, the
same bytes as the pure-Python path for what it answers, None (the Python path decides) for the rest."""

from __future__ import annotations

import random

import msgspec
import pytest
from agl_sidecar.spans import otlp, token_arrays
from agl_sidecar.spans.token_arrays import SliceCache, encode_token_ids
from hypothesis import given, settings
from hypothesis import strategies as st


def test_the_extension_is_built_by_the_install():
    """`pip install -e .` (make venv) compiles it on these machines; a build that silently failed
    would leave the sidecar on the slow path, so this says so."""
    from agl_sidecar import _token_elements

    assert token_arrays.int_array_elements is _token_elements.int_array_elements


def _c(data: bytes):
    assert token_arrays.int_array_elements is not None
    return token_arrays.int_array_elements(data)


def _spell(ids: list[int], rng: random.Random) -> bytes:
    """`ids` as JSON with whitespace wherever JSON allows it."""
    ws = [b"", b" ", b"\n", b"\t", b"\r\n  "]
    parts = [rng.choice(ws) + str(i).encode() + rng.choice(ws) for i in ids]
    inside = b",".join(parts) + (rng.choice(ws) if not ids else b"")
    return rng.choice(ws) + b"[" + inside + b"]" + rng.choice(ws)


@pytest.mark.parametrize("n", [0, 1, 2, 511, 512, 5000])
def test_the_same_bytes_as_the_python_encoder(n):
    rng = random.Random(n)
    edges = [0, (1 << 21) - 1, 127, 128, 16383, 16384] if n else []
    ids = [rng.randrange(0, 1 << 21) for _ in range(n)] + edges
    expected = otlp.IntArray.of(ids)
    for data in (msgspec.json.encode(ids), _spell(ids, rng)):
        assert _c(data) == (expected.elements, len(ids))


@pytest.mark.parametrize(
    "data",
    [
        b"", b"[", b"]", b"[1", b"[1,", b"[1,]", b"[,1]", b"[1 2]", b"[1]x", b"x[1]", b"[[1]]", b"null",
        b"[-1]", b"[-0]", b"[2097152]", b"[99999999]", b"[01]", b"[00]", b"[1.0]", b"[1e3]", b"[1E3]",
        b'["1"]', b"[true]", b"[null]", b"[1,null]", b"{}", b"[\x00]", b"[1\xa0]",
    ],
)
def test_anything_but_a_plain_array_of_small_ids_is_left_to_python(data):
    assert _c(data) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1 << 22), max_size=300), st.randoms(use_true_random=False))
def test_any_spelling_of_any_ids_either_matches_python_or_is_left_to_it(ids, rng):
    data = _spell(ids, rng)
    out = _c(data)
    if any(i >= 1 << 21 for i in ids):
        assert out is None
    else:
        assert out == (otlp.IntArray.of(ids).elements, len(ids))


def _encode(data: bytes, prompt: bool = False):
    generator = encode_token_ids(msgspec.Raw(data), SliceCache(), prompt=prompt)
    while True:
        try:
            next(generator)
        except StopIteration as done:
            return done.value


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize(
    "ids",
    [
        [5, 6, 7],
        list(range(0, 40_000, 3)),  # several slices
        [1 << 21, 5, 1 << 40],  # beyond the fixed width: the Python path's varints
        [random.Random(9).randrange(0, 200_000) for _ in range(10_000)],
    ],
)
def test_span_arrays_are_the_same_with_and_without_the_extension(monkeypatch, ids, prompt):
    rng = random.Random(len(ids))
    for data in (msgspec.json.encode(ids), _spell(ids, rng)):
        fast = _encode(data, prompt)
        monkeypatch.setattr(token_arrays, "int_array_elements", None)
        slow = _encode(data, prompt)
        monkeypatch.undo()
        assert fast.elements == slow.elements == otlp.IntArray.of(ids).elements and fast.length == len(ids)


def test_what_python_refuses_is_refused_with_the_extension_too():
    for data in (b'["a"]', b"[1.5]", b"[01]"):
        with pytest.raises(msgspec.MsgspecError):
            _encode(data)
    assert _encode(b"null") is None
    assert _encode(b"[1.0, 2e0]").elements == otlp.IntArray.of([1, 2]).elements  # integral floats: IDs
