"""Which earlier call a call's prompt extends: an index of full sequences (prompt + completion).

A call's parent is the earlier call whose full sequence its prompt starts with exactly, the
longest such one. Comparing every prompt with every earlier sequence is quadratic in tokens. The
index keeps, per earlier call, its length and a few probe tokens (its last ones, its middle, its
first): one vectorized pass over those rules out, for a prompt, every sequence it cannot extend;
the survivors are confirmed token by token, longest first, and the first confirmed is the parent.
A prompt usually survives only against its own thread's calls, and the longest is its parent.

Naming a break (a prompt that extends nothing) compares prefixes by polynomial hash, computed for
a call only when some break needs it.
"""

from __future__ import annotations

import numpy as np

# Polynomial hash mod 2^64 (uint64 arithmetic wraps; the base is odd). Not collision-proof against
# crafted input, and it need not be: it only names the closest call for a break's diagnosis.
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


_PROBES = 6


def _probe_positions(n: int) -> list[int]:
    """Where a sequence of `n` > 0 tokens keeps its probe tokens: its last three, its middle, a
    third of the way in, its first (clipped into it)."""
    return [max(0, p) for p in (n - 1, n - 2, n - 3, n // 2, n // 3, 0)]


class PrefixIndex:
    """Full sequences of earlier calls, found by the prompts that extend them."""

    def __init__(self) -> None:
        self._seqs: list[int] = []  # ascending
        self._full: list[np.ndarray] = []
        self._prompt_size: dict[int, int] = {}
        self._lengths = np.zeros(16, np.int64)
        self._positions = np.zeros((16, _PROBES), np.int64)
        self._probes = np.zeros((16, _PROBES), np.int64)
        self._hashes: dict[int, np.ndarray] = {}  # prefix hashes, computed when a break needs them

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seq: int, full: np.ndarray, prompt_size: int) -> None:
        """Add call `seq` (seqs come in ascending order)."""
        i = len(self._seqs)
        if i == self._lengths.size:
            self._lengths = np.concatenate([self._lengths, np.zeros(i, np.int64)])
            self._positions = np.concatenate([self._positions, np.zeros((i, _PROBES), np.int64)])
            self._probes = np.concatenate([self._probes, np.zeros((i, _PROBES), np.int64)])
        self._lengths[i] = full.size
        if full.size:
            positions = _probe_positions(int(full.size))
            self._positions[i] = positions
            self._probes[i] = full[positions]
        self._seqs.append(seq)
        self._full.append(full)
        self._prompt_size[seq] = prompt_size

    def prompt_size(self, seq: int) -> int:
        return self._prompt_size[seq]

    def parent(self, prompt: np.ndarray) -> int | None:
        """The earlier call whose full sequence `prompt` extends exactly, the longest such one (the
        earliest of equal ones)."""
        m = len(self._seqs)
        if m == 0:
            return None
        lengths = self._lengths[:m]
        if prompt.size:
            # a sequence longer than the prompt reads clipped probes and is refused by `fits`
            seen = prompt[np.minimum(self._positions[:m], prompt.size - 1)]
            fits = (lengths <= prompt.size) & ((seen == self._probes[:m]).all(axis=1) | (lengths == 0))
        else:
            fits = lengths == 0
        survivors = np.flatnonzero(fits)
        for i in survivors[np.lexsort((survivors, -lengths[survivors]))]:
            full = self._full[i]
            if np.array_equal(full, prompt[: full.size]):
                return self._seqs[i]
        return None

    def closest(self, prompt: np.ndarray, hashes: np.ndarray) -> tuple[int, np.ndarray, int] | None:
        """The earlier call whose full sequence shares the longest common prefix with `prompt`
        (the latest of equal ones), with that sequence and the prefix's length; None when the
        index is empty. `hashes` = prefix_hashes of at least `prompt`. Prefixes are compared by
        hash: a candidate that cannot beat the best so far costs one comparison, one that can a
        binary search (merge.classify then measures the chosen one exactly)."""
        best_common, best = -1, -1
        for i in range(len(self._seqs) - 1, -1, -1):  # latest first: later wins only when strictly closer
            theirs = self.hashes(i)
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
            best_common, best = low, i
            if low == prompt.size:
                break
        if best < 0:
            return None
        return self._seqs[best], self._full[best], best_common

    def hashes(self, i: int) -> np.ndarray:
        found = self._hashes.get(i)
        if found is None:
            found = self._hashes[i] = prefix_hashes(self._full[i])
        return found
