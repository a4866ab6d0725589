"""Which earlier call a call's prompt extends, and which it is closest to: a radix tree of the
full sequences (prompt + completion) of a rollout's earlier calls.

A call's parent is the earlier call whose full sequence its prompt starts with exactly, the
longest such one (the earliest of equal ones). A call that starts a new sample names the earlier
call sharing the longest common prefix with its prompt (the latest of equal ones).

The tree's edges are views of the calls' own token arrays (no copy); a sequence's end is a mark on
the edge where it ends, so a thread whose every call extends the last one is a single edge that
grows. Walking a prompt down the tree compares each of its tokens at most once, and a walk can
start where a known prefix of the prompt ends (a prompt sent by reference, or its parent for the
full sequence): a rollout costs about its new tokens, not its calls times its context, which is
what kept a 20,000-call rollout from assembling at all (`operations` counts the work, for tests).
"""

from __future__ import annotations

import bisect

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0 or np.array_equal(a[:n], b[:n]):  # the common case (a thread's next call) allocates nothing
        return n
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class _Node:
    """A segment of tokens at depths [start, start + tokens.size), with the sequences that end in
    (start, start + size] (the root: depth 0) as (depth, index) ascending, its children by first
    token, and the latest index ending in it or below."""

    __slots__ = ("start", "tokens", "ends", "children", "latest", "up")

    def __init__(self, start: int, tokens: np.ndarray, up: _Node | None) -> None:
        self.start = start
        self.tokens = tokens
        self.ends: list[tuple[int, int]] = []
        self.children: dict[int, _Node] = {}
        self.latest = -1
        self.up = up

    @property
    def end(self) -> int:
        return self.start + int(self.tokens.size)


_NONE = np.zeros(0, np.int64)


class PrefixIndex:
    """Full sequences of earlier calls, found by the prompts that extend them."""

    def __init__(self) -> None:
        self._root = _Node(0, _NONE, None)
        self._seqs: list[int] = []  # ascending
        self._index: dict[int, int] = {}  # seq -> position in _seqs
        self._full: list[np.ndarray] = []
        self._where: list[_Node] = []  # the node where each sequence ends
        self._prompt_size: dict[int, int] = {}
        # The latest sequence's node and index, not yet recorded in its ancestors' `latest`: a
        # thread that grows one leaf pays for the walk up to the root once, not once per call.
        self._head: tuple[_Node, int] | None = None
        self.operations = 0  # tokens compared + nodes visited (the work, counted for tests)

    def __len__(self) -> int:
        return len(self._seqs)

    def prompt_size(self, seq: int) -> int:
        return self._prompt_size[seq]

    # --- walking ---------------------------------------------------------------------------------
    def _start(self, known: tuple[int, int] | None) -> tuple[_Node, int]:
        """Where a walk may start: (node, depth) at the end of a prefix known to match, given as
        (an earlier call's seq, how many of its tokens); else the root."""
        if known is None or known[0] not in self._index:
            return self._root, 0
        i = self._index[known[0]]
        depth = min(known[1], int(self._full[i].size))
        node = self._where[i]
        while node.up is not None and node.start >= depth:
            node = node.up
            self.operations += 1
        return (node, depth) if node.up is not None else (self._root, 0)

    def _walk(self, tokens: np.ndarray, node: _Node, depth: int) -> tuple[_Node, int]:
        """Follow `tokens` from (node, depth) as far as they match: (node, depth) where they stop."""
        n = int(tokens.size)
        while True:
            end = node.end
            if depth < end:
                stop = min(end, n)
                self.operations += stop - depth + 1
                depth += common_prefix(node.tokens[depth - node.start : stop - node.start], tokens[depth:stop])
                if depth < end:
                    return node, depth
            if depth >= n:
                return node, depth
            child = node.children.get(int(tokens[depth]))
            if child is None:
                return node, depth
            node = child
            self.operations += 1

    # --- queries ---------------------------------------------------------------------------------
    def parent(self, prompt: np.ndarray, known: tuple[int, int] | None = None) -> int | None:
        """The earlier call whose full sequence `prompt` extends exactly, the longest such one (the
        earliest of equal ones). `known`: (seq, n) when prompt[:n] is known to equal that call's
        first n tokens (the walk starts there)."""
        if not self._seqs:
            return None
        node, depth = self._walk(prompt, *self._start(known))
        current: _Node | None = node
        while current is not None:  # the deepest end at or above where the walk stopped
            ends = current.ends
            k = bisect.bisect_right(ends, (depth, len(self._seqs))) - 1
            self.operations += 1
            if k >= 0:
                deepest = ends[k][0]
                return self._seqs[ends[bisect.bisect_left(ends, (deepest, -1))][1]]
            current = current.up
        return None

    def closest(self, prompt: np.ndarray, known: tuple[int, int] | None = None) -> tuple[int, np.ndarray, int] | None:
        """The earlier call whose full sequence shares the longest common prefix with `prompt`
        (the latest of equal ones), with that sequence and the prefix's length; None when the
        index is empty. `known` as for `parent`."""
        if not self._seqs:
            return None
        self._settle()
        node, depth = self._walk(prompt, *self._start(known))
        # every sequence through this point shares exactly `depth` tokens with the prompt
        tail = node.ends[bisect.bisect_left(node.ends, (depth, -1)) :]
        best = max((i for _, i in tail), default=-1)
        for child in node.children.values():
            if child.start >= depth:
                best = max(best, child.latest)
        self.operations += len(tail) + len(node.children)
        return self._seqs[best], self._full[best], depth

    # --- adding ----------------------------------------------------------------------------------
    def add(self, seq: int, full: np.ndarray, prompt_size: int, known: tuple[int, int] | None = None) -> None:
        """Add call `seq` (seqs come in ascending order); `known` as for `parent`."""
        i = len(self._seqs)
        node, depth = self._walk(full, *self._start(known))
        if depth < full.size:
            if depth < node.end:
                self._settle()
                self._split(node, depth)
            if not node.children and node.up is not None:  # a leaf: the thread grows in place
                node.tokens = full[node.start :]
            else:
                child = _Node(depth, full[depth:], node)
                node.children[int(full[depth])] = child
                node = child
        bisect.insort(node.ends, (int(full.size), i))  # a thread's next call: at the end
        self._seqs.append(seq)
        self._index[seq] = i
        self._full.append(full)
        self._where.append(node)
        self._prompt_size[seq] = prompt_size
        if self._head is not None and self._head[0] is not node:
            self._settle()
        self._head = (node, i)

    def _settle(self) -> None:
        """Record the latest sequence in its node's ancestors (up to one already holding it)."""
        if self._head is None:
            return
        node: _Node | None
        node, i = self._head
        self._head = None
        while node is not None and node.latest != i:
            node.latest = i
            node = node.up
            self.operations += 1

    def _split(self, node: _Node, depth: int) -> None:
        """Cut `node` at `depth` (inside it): the part after becomes its only child."""
        cut = depth - node.start
        tail = _Node(depth, node.tokens[cut:], node)
        tail.children, node.children = node.children, {int(node.tokens[cut]): tail}
        for child in tail.children.values():
            child.up = tail
        k = bisect.bisect_right(node.ends, (depth, len(self._seqs)))
        tail.ends, node.ends = node.ends[k:], node.ends[:k]
        for _, i in tail.ends:
            self._where[i] = tail
        tail.latest = max([i for _, i in tail.ends] + [c.latest for c in tail.children.values()], default=-1)
        node.tokens = node.tokens[:cut]
        self.operations += len(tail.ends) + len(tail.children)
