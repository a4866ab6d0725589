"""The data plane as the loop sees it: the rollout store (filled by the receiver) plus assembly."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from agl_trainer.loop.ports import Assembled, GroupRewards
from agl_trainer.store import Cause, RolloutKey, RolloutStore
from agl_trainer.store.records import RolloutData

# The cause the store records for a harness that ended so: OK leaves it to the exit code; a harness
# the loop cancelled did not fail on its own, so its partial rollout counts as an infrastructure end.
_HARNESS_CAUSE: dict[str, Cause | None] = {
    Cause.OK.value: None,
    Cause.HARNESS_ERROR.value: Cause.HARNESS_ERROR,
    Cause.TIMEOUT.value: Cause.TIMEOUT,
    Cause.INFRA_ERROR.value: Cause.INFRA_ERROR,
    Cause.CANCELLED.value: Cause.INFRA_ERROR,
}


class StoreDataPlane:
    def __init__(self, store: RolloutStore, assembly: Any = None, tokenizer: Any = None) -> None:
        from agl_trainer.assembly import AssemblyConfig

        self.store = store
        self.assembly = assembly or AssemblyConfig()
        self.tokenizer = tokenizer

    def complete(self, keys: Collection[RolloutKey]) -> set[RolloutKey]:
        return self.store.completed(keys) if keys else set()

    def harness_exited(self, key: RolloutKey, exit_code: int | None, cause: str) -> None:
        if cause == Cause.OK and exit_code is None:
            exit_code = 0  # a function harness that returned
        self.store.mark_harness_exited(key.rollout_id, exit_code, _HARNESS_CAUSE.get(cause), attempt=key.attempt)

    def assemble(self, keys: list[RolloutKey]) -> Assembled:
        from agl_trainer.assembly import assemble

        self.store.refresh_completion()  # record the end causes `complete` saw due
        assembly = assemble(self.store, keys, self.assembly, self.tokenizer)  # drops are recorded in the store
        return Assembled(assembly.rollouts, _report_metrics(assembly.report))

    def group_rewards(self, keys: Collection[RolloutKey]) -> GroupRewards | None:
        from agl_trainer.assembly.assemble import awaits_reward, has_call_rewards, training_reward

        keys = list(keys)
        infos = [self.store.rollout(key) for key in keys]
        if any(info is not None and not info.complete for info in infos):
            # due but not yet recorded: record their end causes (the reward policy reads them) once, not
            # at every poll while the group waits for its rewards (refresh_completion is a write)
            self.store.refresh_completion()
            infos = [self.store.rollout(key) for key in keys]
        found = GroupRewards([])
        for key, info in zip(keys, infos):
            if info is None:
                continue
            data = RolloutData(info=info, calls=[], rewards=self.store.rewards(key))  # no calls: cheap
            if has_call_rewards(data, self.assembly):
                return None
            found.awaited += awaits_reward(data, self.assembly)
            reward = training_reward(data, self.assembly)
            if reward is not None:
                found.rewards.append(reward)
        return found

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
