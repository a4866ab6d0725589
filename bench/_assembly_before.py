"""The reference for bench/viewer.py --big: rollout assembly as it was before it became near-linear
(commit e0ee083): the call-tree index of probe tokens and prefix hashes, and prompts sent by
reference rebuilt as copies (each call's whole context again). `patched()` puts both into today's
assemble_rollout, so the two are measured on the same code otherwise, in the same run."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

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


class PrefixIndexBefore:
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

    def add(self, seq: int, full: np.ndarray, prompt_size: int, known: object = None) -> None:
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

    def parent(self, prompt: np.ndarray, known: object = None) -> int | None:
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

    def closest(self, prompt: np.ndarray, known: object = None) -> tuple[int, np.ndarray, int] | None:
        hashes = prefix_hashes(prompt)
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


def _rebuild_prompts_before(calls, problems, placements):  # type: ignore[no-untyped-def]
    """assemble._rebuild_prompts before e0ee083: every prompt by reference is a new concatenation."""
    assemble = importlib.import_module("agl_trainer.assembly.assemble")
    semconv = assemble.semconv
    usable, full = {}, {}
    for call in calls:
        if call.call_seq in placements:
            assemble._count(problems, assemble.DUPLICATE_CALL_SEQ)
            continue
        placement = assemble.CallPlacement(call_seq=call.call_seq, sample=None, policy_version=assemble._version(call),
                                           origin=call.origin)  # fmt: skip
        placements[call.call_seq] = placement
        problem, prompt = None, call.prompt_ids
        if call.tokens_source == semconv.TOKENS_ABSENT or prompt is None or call.completion_ids is None:
            problem = assemble.TOKENS_ABSENT
        elif call.prompt_ref_seq is not None:
            placement.prompt_from_reference = True
            base = full.get(call.prompt_ref_seq)
            if base is None:
                problem = assemble.MISSING_REFERENCE
            elif call.prompt_ref_length is None or call.prompt_ref_length > base.size:
                problem = assemble.BAD_REFERENCE_LENGTH
            else:
                prompt = np.concatenate([base[: call.prompt_ref_length], prompt])
        if problem is None and call.prompt_length is not None and call.prompt_length != prompt.size:
            problem = assemble.PROMPT_LENGTH_MISMATCH
        if problem is not None:
            placement.problem = problem
            assemble._count(problems, problem)
            continue
        full[call.call_seq] = np.concatenate([prompt, call.completion_ids])
        usable[call.call_seq] = (call, prompt, full[call.call_seq])
    return usable


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Today's assemble_rollout with the index and prompt rebuilding it had before."""
    assemble = importlib.import_module("agl_trainer.assembly.assemble")
    saved = assemble.PrefixIndex, assemble._rebuild_prompts
    assemble.PrefixIndex, assemble._rebuild_prompts = PrefixIndexBefore, _rebuild_prompts_before
    try:
        yield
    finally:
        assemble.PrefixIndex, assemble._rebuild_prompts = saved
