"""agl.call.seq: a call's identity and order in its rollout, with no state shared between sidecars.

A counter from 0 per process numbered a rollout 0, 1, 2, 0, 1, 2 when its sidecar restarted (or the
rollout fell out of the in-memory table, or a second sidecar served it): the store then held each
number twice and assembly dropped the later turns. So a seq is a clock reading:

    seq = microseconds since the Unix epoch << 8 | instance

`instance` is a random byte per sidecar process (two sidecars seldom share one, and then two calls
of one rollout would also have to arrive in the same microsecond), and within a process a rollout's
seqs strictly increase (the next is at least the last + 256, keeping the instance byte), so seqs
order a rollout's calls by arrival across restarts and sidecars (as far as their clocks agree).
The values are about 2^59 until the year 2100, inside the contract's 0..2^63-1. They are not
positions: a per-call reward names its call by position (0 = the rollout's first call) or by seq.
"""

from __future__ import annotations

import secrets
import time

INSTANCE_BITS = 8
_STEP = 1 << INSTANCE_BITS


class CallSeqs:
    def __init__(self, instance: int | None = None) -> None:
        self.instance = secrets.randbelow(_STEP) if instance is None else instance
        if not 0 <= self.instance < _STEP:
            raise ValueError(f"instance must be in 0..{_STEP - 1}")

    def at(self, time_ns: int) -> int:
        """The seq of a call arriving at `time_ns` (wall clock), before ordering within its rollout."""
        return (time_ns // 1000) << INSTANCE_BITS | self.instance

    def next(self, last: int, time_ns: int | None = None) -> int:
        """The seq after `last` (-1: the rollout's first call here) for a call arriving now."""
        return max(self.at(time.time_ns() if time_ns is None else time_ns), last + _STEP)
