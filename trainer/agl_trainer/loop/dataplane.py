"""The data plane as the loop sees it: the rollout store (filled by the receiver) plus assembly."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from agl import semconv
from agl_trainer.loop.ports import Assembled
from agl_trainer.runners.base import Cause
from agl_trainer.store import CAUSE_HARNESS_ERROR, CAUSE_INFRASTRUCTURE_ERROR, CAUSE_TIMEOUT, RolloutKey, RolloutStore

_STORE_CAUSE = {
    Cause.OK.value: None,  # the exit code says it
    Cause.HARNESS_ERROR.value: CAUSE_HARNESS_ERROR,
    Cause.TIMEOUT.value: CAUSE_TIMEOUT,
    Cause.INFRA_ERROR.value: CAUSE_INFRASTRUCTURE_ERROR,
    Cause.CANCELLED.value: CAUSE_INFRASTRUCTURE_ERROR,
}


class StoreDataPlane:
    def __init__(self, store: RolloutStore, assembly: Any = None, tokenizer: Any = None) -> None:
        from agl_trainer.assembly import AssemblyConfig

        self.store = store
        self.assembly = assembly or AssemblyConfig()
        self.reward_name = self.assembly.reward_name
        self.tokenizer = tokenizer

    def complete(self, keys: Collection[RolloutKey]) -> set[RolloutKey]:
        wanted = set(keys)
        if not wanted:
            return set()
        ready = {info.key for mode in semconv.MODES for info in self.store.ready_rollouts(mode)}
        return wanted & ready

    def harness_exited(self, key: RolloutKey, exit_code: int | None, cause: str) -> None:
        if cause == Cause.OK.value and exit_code is None:
            exit_code = 0  # a function harness that returned
        self.store.mark_harness_exited(key.rollout_id, exit_code, _STORE_CAUSE.get(cause), attempt=key.attempt)

    def assemble(self, keys: list[RolloutKey]) -> Assembled:
        from agl_trainer.assembly import assemble

        assembly = assemble(self.store, keys, self.assembly, self.tokenizer)  # drops are recorded in the store
        return Assembled(assembly.rollouts, _report_metrics(assembly.report))

    def rewards(self, keys: Collection[RolloutKey]) -> dict[RolloutKey, float]:
        out: dict[RolloutKey, float] = {}
        for key in keys:
            data = self.store.load(key)
            values = [row.value for row in data.rewards if row.name == self.reward_name and row.call_seq is None]
            if values:
                out[key] = float(values[-1])
        return out

    def mark_trained(self, keys: list[RolloutKey], step: int) -> None:
        self.store.mark_trained(keys, step)

    def mark_dropped(self, keys: list[RolloutKey], reason: str) -> None:
        if keys:
            self.store.mark_dropped([(key, reason) for key in keys])


def _report_metrics(report: Any) -> dict[str, float]:
    if report is None:
        return {}
    if isinstance(report, dict):
        items = report.items()
    else:
        import msgspec

        items = msgspec.to_builtins(report).items() if hasattr(report, "__struct_fields__") else vars(report).items()
    out: dict[str, float] = {}
    for name, value in items:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, dict):
            for sub, number in value.items():
                if isinstance(number, (int, float)) and not isinstance(number, bool):
                    out[f"{name}/{sub}"] = float(number)
    return out
