"""Several sidecars (one per engine node) driven as one: pause and resume all, state summed.

A drained pause counts only when every sidecar drained; a rollout's reward goes to the sidecar
that serves it (`runners.base.sidecar_index`, the same choice the runner made).
"""

from __future__ import annotations

import asyncio

from agl_trainer.loop.ports import RELEASE, Resume, SidecarState
from agl_trainer.run.sidecar_client import SidecarAdmin
from agl_trainer.runners.base import sidecar_index

_SUMMED = (
    "in_flight", "held", "spans_building", "spans_pending", "spans_sending", "spans_in_spool",
    "spans_dead_lettered", "spans_failed",
)


class SidecarFleet:
    def __init__(self, admins: list[SidecarAdmin]) -> None:
        if not admins:
            raise ValueError("SidecarFleet needs at least one sidecar")
        self.admins = admins

    async def pause(self, *, drain: bool = True, timeout_s: float = 60.0, keep: bool = False) -> SidecarState:
        states = await asyncio.gather(
            *(a.pause(drain=drain, timeout_s=timeout_s, keep=keep) for a in self.admins)
        )
        return merge_states(list(states))

    async def resume(self, request: Resume = RELEASE) -> SidecarState:
        # The engine's progress is keyed by request id: each sidecar finds its own calls in it.
        return merge_states(list(await asyncio.gather(*(a.resume(request) for a in self.admins))))

    async def flush(self, timeout_s: float = 30.0) -> SidecarState:
        return merge_states(list(await asyncio.gather(*(a.flush(timeout_s) for a in self.admins))))

    async def state(self) -> SidecarState:
        return merge_states(list(await asyncio.gather(*(a.state() for a in self.admins))))

    async def emit_reward(self, rollout_id: str, value: float, name: str = "reward") -> None:
        await self.admins[sidecar_index(rollout_id, len(self.admins))].emit_reward(rollout_id, value, name)

    async def aclose(self) -> None:
        await asyncio.gather(*(a.aclose() for a in self.admins))


def merge_states(states: list[SidecarState]) -> SidecarState:
    merged = SidecarState(
        paused=all(s.paused for s in states),
        policy_version=min(s.policy_version for s in states),
        upstreams=sorted({u for s in states for u in s.upstreams}),
        spans_flushed=all(s.spans_flushed for s in states),
    )
    for name in _SUMMED:
        setattr(merged, name, sum(getattr(s, name) for s in states))
    return merged
