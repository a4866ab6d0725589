"""A mapping bounded by bytes (and optionally by entries) that evicts the least recently used.

The sidecar keeps three such caches: encoded token-array slices, each rollout's last token sequence
(for prompt references) and Responses API conversations. Sizes are what the caller's `size_of`
says an entry holds; an entry larger than the whole bound is not kept (it would evict everything).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BytesLRU(Generic[K, V]):
    __slots__ = ("_items", "_size_of", "bytes", "max_bytes", "max_entries")

    def __init__(self, max_bytes: int, size_of: Callable[[K, V], int], max_entries: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.bytes = 0
        self._size_of = size_of
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Keep `value` under `key` (replacing what was there), evicting the least recently used."""
        self.pop(key)
        size = self._size_of(key, value)
        if size > self.max_bytes:
            return
        self._items[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes or (self.max_entries is not None and len(self._items) > self.max_entries):
            old_key, old = self._items.popitem(last=False)
            self.bytes -= self._size_of(old_key, old)

    def pop(self, key: K) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= self._size_of(key, old)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
