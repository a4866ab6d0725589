"""Rollout assembly: stored spans -> `RolloutResult`s with token-exact `Sample`s.

result = assemble(store, store.ready_rollouts(), AssemblyConfig(), tokenizer=None)
result.rollouts   # list[RolloutResult], ready for TrainingBatch.from_rollouts
result.report     # AssemblyReport: merge failures by class, truncations, call problems, drops
result.details    # list[RolloutAssembly], one per rollout asked for (what inspect shows)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from agl_trainer.assembly.assemble import CallPlacement, RolloutAssembly, assemble_rollout
from agl_trainer.assembly.config import AssemblyConfig
from agl_trainer.assembly.merge import MergeFailure
from agl_trainer.assembly.report import AssemblyReport
from agl_trainer.batch import RolloutResult
from agl_trainer.store.records import RolloutInfo, RolloutKey
from agl_trainer.store.rollout_store import RolloutStore


class Assembly(msgspec.Struct):
    rollouts: list[RolloutResult]
    report: AssemblyReport
    details: list[RolloutAssembly]

    @property
    def dropped(self) -> list[tuple[RolloutKey, str]]:
        return [(item.key, item.dropped) for item in self.details if item.dropped is not None]


def assemble(
    store: RolloutStore,
    rollouts: Iterable[RolloutInfo | RolloutKey | str],
    config: AssemblyConfig | None = None,
    tokenizer: Any = None,
    *,
    record_drops: bool = True,
) -> Assembly:
    """Assemble `rollouts` from `store`. With `record_drops`, rollouts the policies drop are marked
    dropped in the store (with the reason), so `ready_rollouts` does not offer them again."""
    config = config or AssemblyConfig()
    report = AssemblyReport(
        merge_failures={}, merge_failures_by={}, truncations={}, call_problems={}, dropped={}
    )
    results: list[RolloutResult] = []
    details: list[RolloutAssembly] = []
    for item in rollouts:
        key = item.key if isinstance(item, RolloutInfo) else item
        detail = assemble_rollout(store.load(key), config, tokenizer)
        report.add(detail)
        details.append(detail)
        if detail.result is not None:
            results.append(detail.result)
    assembly = Assembly(rollouts=results, report=report, details=details)
    if record_drops and assembly.dropped:
        store.mark_dropped(assembly.dropped)
    return assembly


__all__ = [
    "Assembly",
    "AssemblyConfig",
    "AssemblyReport",
    "CallPlacement",
    "MergeFailure",
    "RolloutAssembly",
    "assemble",
    "assemble_rollout",
]
