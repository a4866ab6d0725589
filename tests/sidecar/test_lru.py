"""The sidecar's byte-bounded LRU (token-slice cache, prompt references, Responses conversations)."""

from __future__ import annotations

from agl_sidecar.spans.lru import BytesLRU


def _lru(max_bytes: int, max_entries: int | None = None) -> BytesLRU[str, bytes]:
    return BytesLRU(max_bytes, lambda key, value: len(value), max_entries)


def test_evicts_the_least_recently_used_past_the_byte_bound():
    lru = _lru(10)
    lru.put("a", b"xxxx")
    lru.put("b", b"xxxx")
    assert lru.get("a") == b"xxxx"  # now "b" is the least recently used
    lru.put("c", b"xxxx")
    assert "b" not in lru and "a" in lru and "c" in lru and lru.bytes == 8


def test_replacing_a_key_counts_its_bytes_once_and_pop_returns_them():
    lru = _lru(100)
    lru.put("a", b"x" * 30)
    lru.put("a", b"x" * 10)
    assert lru.bytes == 10 and len(lru) == 1
    lru.pop("a")
    lru.pop("missing")
    assert lru.bytes == 0 and len(lru) == 0 and lru.get("a") is None


def test_an_entry_larger_than_the_bound_is_not_kept_and_evicts_nothing():
    lru = _lru(10)
    lru.put("small", b"xxx")
    lru.put("huge", b"x" * 11)
    assert "huge" not in lru and lru.get("small") == b"xxx" and lru.bytes == 3


def test_the_entry_bound_evicts_too():
    lru = _lru(1_000, max_entries=2)
    for key in "abc":
        lru.put(key, b"x")
    assert [key for key in "abc" if key in lru] == ["b", "c"] and lru.bytes == 2
