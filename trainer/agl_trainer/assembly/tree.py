"""Which earlier call a call's prompt extends: an index of full sequences (prompt + completion).

A call's parent is the earlier call whose full sequence its prompt starts with exactly, the
longest such one. Comparing every prompt with every earlier sequence is quadratic in tokens, so
sequences are found by (length, prefix hash): one vectorized hash pass per call gives the hash of
every prefix of its prompt, and only the distinct lengths of earlier sequences are looked up. A
hash match is confirmed token by token (a collision costs one comparison, never a wrong merge).
"""

from __future__ import annotations

import bisect

import numpy as np

# Polynomial hash mod 2^64 (uint64 arithmetic wraps; the base is odd). Not collision-proof against
# crafted input, and it need not be: every match is confirmed token by token.
_BASE = np.uint64(0x9E3779B97F4A7C15)
_powers = np.ones(1, np.uint64)


def _powers_for(n: int) -> np.ndarray:
    global _powers
    if _powers.size < n:
        size = max(n, 2 * _powers.size)
        steps = np.full(size, _BASE, np.uint64)
        steps[0] = np.uint64(1)
        with np.errstate(over="ignore"):
            _powers = np.cumprod(steps, dtype=np.uint64)
    return _powers[:n]


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """uint64[n + 1]: element i is the hash of tokens[:i]."""
    with np.errstate(over="ignore"):
        x = tokens.astype(np.uint64)
        x += np.uint64(1)
        x *= _powers_for(tokens.size)
        out = np.empty(tokens.size + 1, np.uint64)
        out[0] = 0
        np.cumsum(x, dtype=np.uint64, out=out[1:])
    return out


class PrefixIndex:
    """Full sequences of earlier calls, found by the prompts that extend them."""

    def __init__(self) -> None:
        self._lengths: list[int] = []  # distinct lengths, ascending
        self._by_key: dict[tuple[int, int], list[int]] = {}  # (length, hash) -> call seqs, ascending
        self._full: dict[int, np.ndarray] = {}
        self._hashes: dict[int, np.ndarray] = {}  # prefix hashes of each full sequence
        self._prompt_size: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._full)

    def add(self, seq: int, full: np.ndarray, hashes: np.ndarray, prompt_size: int) -> None:
        """Add call `seq` (seqs come in ascending order); `hashes` = prefix_hashes(full)."""
        n = int(full.size)
        self._by_key.setdefault((n, int(hashes[n])), []).append(seq)
        self._full[seq] = full
        self._hashes[seq] = hashes
        self._prompt_size[seq] = prompt_size
        at = bisect.bisect_left(self._lengths, n)
        if at == len(self._lengths) or self._lengths[at] != n:
            self._lengths.insert(at, n)

    def prompt_size(self, seq: int) -> int:
        return self._prompt_size[seq]

    def parent(self, prompt: np.ndarray, hashes: np.ndarray) -> int | None:
        """The earlier call whose full sequence `prompt` extends exactly, the longest such one (the
        earliest of equal ones); `hashes` holds the prefix hashes of at least `prompt`."""
        for i in range(bisect.bisect_right(self._lengths, prompt.size) - 1, -1, -1):
            n = self._lengths[i]
            for seq in self._by_key.get((n, int(hashes[n])), ()):
                if np.array_equal(self._full[seq], prompt[:n]):
                    return seq
        return None

    def closest(self, prompt: np.ndarray, hashes: np.ndarray) -> tuple[int, np.ndarray, int] | None:
        """The earlier call whose full sequence shares the longest common prefix with `prompt`
        (the latest of equal ones), with that sequence and the prefix's length; None when the
        index is empty. Prefixes are compared by hash: a candidate that cannot beat the best so
        far costs one comparison, one that can a binary search (no token-by-token scan: this
        only names the break, which merge.classify then measures exactly)."""
        best_common, best_seq = -1, None
        for seq in reversed(self._full):  # latest first: a later call wins only when strictly closer
            theirs = self._hashes[seq]
            n = min(theirs.size - 1, prompt.size)
            low = best_common + 1
            if low > n or theirs[low] != hashes[low]:
                continue
            high = n
            while low < high:
                mid = (low + high + 1) // 2
                if theirs[mid] == hashes[mid]:
                    low = mid
                else:
                    high = mid - 1
            best_common, best_seq = low, seq
            if low == prompt.size:
                break
        if best_seq is None:
            return None
        return best_seq, self._full[best_seq], best_common
