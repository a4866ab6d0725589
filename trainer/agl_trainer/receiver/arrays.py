"""Vectorised decoding of OTLP `ArrayValue`s of ints and doubles straight from protobuf bytes.

An `ArrayValue` is `repeated AnyValue values = 1`; an int element is encoded as
`0x0a <len> 0x18 <varint>` and a double element as `0x0a 0x09 0x21 <8 bytes>`. In an int array
every element therefore has exactly four bytes below 0x80 (the tag, the length, the inner tag and
the varint's last byte), which lets numpy find every varint without a Python loop. Anything that
does not match this canonical layout returns None and takes the generic path.
"""

from __future__ import annotations

import numpy as np

_MAX_FAST_VARINT = 9  # 10-byte varints are negative int64s: rare, left to the generic path


def decode_int_array(buf: bytes, start: int, end: int) -> np.ndarray | None:
    """The int64 values of an ArrayValue whose elements are all `int_value`, else None."""
    if end <= start:
        return None
    decoded = _canonical_ints(np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start))
    return None if decoded is None else decoded[0]


def decode_double_array(buf: bytes, start: int, end: int) -> np.ndarray | None:
    """The float64 values of an ArrayValue whose elements are all `double_value`, else None."""
    size = end - start
    if size == 0 or size % 11:
        return None
    rows = np.frombuffer(buf, dtype=np.uint8, count=size, offset=start).reshape(-1, 11)
    if not ((rows[:, 0] == 0x0A).all() and (rows[:, 1] == 0x09).all() and (rows[:, 2] == 0x21).all()):
        return None
    return np.ascontiguousarray(rows[:, 3:]).view("<f8").ravel()


def _canonical_ints(data: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, index of each element's last byte) of a canonical int ArrayValue body, else None."""
    size = data.size
    if size == 0 or data[0] != 0x0A or data[-1] >= 0x80:
        return None
    low = np.flatnonzero(data < 0x80)  # 4 per element: tag, length, inner tag, the varint's last byte
    if low.size % 4:
        return None
    steps = np.diff(low, append=low[-1] + 1).reshape(-1, 4)
    varint_lengths = steps[:, 2]  # the other three steps are 1: the marker bytes are adjacent
    if np.count_nonzero(steps != 1) != np.count_nonzero(varint_lengths != 1):
        return None
    markers = data[low].view("<u4")  # per element: tag | length << 8 | inner tag << 16 | last byte << 24
    if not ((markers & 0xFFFFFF) == (0x18000A | ((varint_lengths + 1) << 8))).all():
        return None
    longest = int(varint_lengths.max())
    if longest > _MAX_FAST_VARINT:
        return None
    dtype = np.int32 if longest <= 4 else np.int64  # 4 varint bytes hold 28 bits
    last = low[3::4]
    values = (markers >> 24).astype(dtype)  # the most significant 7 bits first
    for j in range(1, longest):  # fold in the earlier bytes
        shifted = (values << 7) | (data[last - j] & 0x7F).astype(dtype)
        values = np.where(varint_lengths > j, shifted, values)
    return values.astype(np.int64, copy=False), last


def decode_int_arrays(buf: bytes, ranges: list[tuple[int, int]]) -> list[np.ndarray | None]:
    """Decode many int ArrayValues of one request in a single vectorised pass.

    Values come back as int32 when every value of the request is in [0, 2^31) (token IDs are), else
    int64; callers may rely on int32 meaning "non-negative and in range".
    An array that is not canonical makes the batch fall back to one array at a time (None for an
    array that is not a canonical int array at all)."""
    if not ranges:
        return []
    data = np.concatenate(
        [np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start) for start, end in ranges]
    )
    decoded = _canonical_ints(data)
    if decoded is not None:
        values, last = decoded
        bounds = np.cumsum([end - start for start, end in ranges])
        counts = np.searchsorted(last, bounds - 1, side="right")
        if (
            np.array_equal(last[np.minimum(counts - 1, last.size - 1)], bounds - 1)
            and (np.diff(counts) > 0).all()
        ):
            if values.size and values.min() >= 0 and values.max() <= np.iinfo(np.int32).max:
                values = values.astype(np.int32)
            return np.split(values, counts[:-1])
    return [decode_int_array(buf, start, end) for start, end in ranges]
