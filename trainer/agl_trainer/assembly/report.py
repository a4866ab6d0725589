"""What an assembly pass counted, summed over rollouts."""

from __future__ import annotations

import msgspec

from agl_trainer.assembly.assemble import START_BRANCH, START_COMPACTION, START_CONTEXT_EDIT, RolloutAssembly


class AssemblyReport(msgspec.Struct):
    rollouts: int = 0  # assembled into results
    samples: int = 0
    calls: int = 0  # calls placed into samples
    merged_calls: int = 0  # calls appended to their parent's sample (the call tree, assemble.py)
    branched_calls: int = 0  # calls that extend a call another child continues: new sample, prefix as context
    compaction_calls: int = 0  # calls after a declared compaction: each starts a new sample
    context_edit_calls: int = 0  # calls whose prompt the sidecar edited that extend no earlier call: new samples
    # calls whose prefix-built parent disagrees with the agents the harness declared (assemble.py DECLARED_*)
    declared_tree_disagreements: int = 0
    trained_tokens: int = 0
    merge_failures: dict[str, int] = {}  # template / retokenization / other
    merge_failures_by: dict[str, int] = {}  # tokenizer / special_ids / heuristic
    truncations: dict[str, int] = {}
    call_problems: dict[str, int] = {}
    dropped: dict[str, int] = {}  # rollouts dropped, by reason

    def add(self, item: RolloutAssembly) -> None:
        def bump(counter: dict[str, int], key: str, n: int = 1) -> None:
            counter[key] = counter.get(key, 0) + n

        for failure in item.merge_failures:
            bump(self.merge_failures, failure.kind)
            bump(self.merge_failures_by, failure.classified_by)
        for key, n in item.truncations.items():
            bump(self.truncations, key, n)
        for key, n in item.problems.items():
            bump(self.call_problems, key, n)
        if item.result is None:
            bump(self.dropped, item.dropped or "unknown")
            return
        self.rollouts += 1
        self.samples += len(item.result.samples)
        placed = [p for p in item.placements if p.sample is not None]
        self.calls += len(placed)
        self.merged_calls += sum(p.merged for p in placed)
        self.branched_calls += sum(p.start == START_BRANCH for p in placed)
        self.compaction_calls += sum(p.start == START_COMPACTION for p in placed)
        self.context_edit_calls += sum(p.start == START_CONTEXT_EDIT for p in placed)
        self.declared_tree_disagreements += sum(p.declared is not None for p in item.placements)
        self.trained_tokens += sum(s.num_trained_tokens for s in item.result.samples)
