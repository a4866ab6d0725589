"""The training batch: what assembly produces and what algorithms and backends consume.

A `Sample` is one token sequence of one rollout (a rollout's calls merge into one sample when each
prompt extends the previous sequence exactly; otherwise the rollout has several samples). Tokens the
engine generated have loss_mask 1; prompt tokens and tokens between merged calls (tool results,
template text) have loss_mask 0. `TrainingBatch` is samples padded into tensors, plus the rollout
and group structure the rollout-level algorithms need. It does not depend on verl
(the verl backend deals its tensors to its workers itself: backends/verl/payload.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only where a batch is padded: assembly and `agl` config stay light
    import torch


@dataclass
class Sample:
    """One sequence of one rollout. All per-token lists have the same length."""

    rollout_id: str
    task_id: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 where the engine generated the token and it is trained
    engine_logprobs: list[float]  # the engine's logprob of each generated token, 0.0 elsewhere
    policy_versions: list[int]  # the policy version that generated each token, -1 elsewhere
    call_seqs: list[int] = field(default_factory=list)  # the calls merged into this sample, in order
    token_rewards: list[float] | None = None  # per-call rewards placed on a call's last token
    # 0 where the engine gave no usable logprob (missing, NaN): its engine_logprobs 0.0 is a placeholder
    # the backends never weigh with (backends/agreement.py re-scores or excludes). None: all known.
    logprob_known: list[int] | None = None
    # 1 where a token was sampled after a drain-free switch (loop.switch: keep) in the same call: over
    # the old weights' KV of its prefix, so it is expected to differ from the trainer's forward. None: none.
    after_switch: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        lengths = {
            "loss_mask": len(self.loss_mask),
            "engine_logprobs": len(self.engine_logprobs),
            "policy_versions": len(self.policy_versions),
        }
        for name in ("token_rewards", "logprob_known", "after_switch"):
            values = getattr(self, name)
            if values is not None:
                lengths[name] = len(values)
        bad = {name: length for name, length in lengths.items() if length != n}
        if bad:
            raise ValueError(f"Sample {self.rollout_id}: token_ids has {n} tokens but {bad}")

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RolloutResult:
    """A finished rollout ready to train on: its samples and its scalar reward."""

    rollout_id: str
    task_id: str
    reward: float
    samples: list[Sample]
    attempt: int = 0
    end_cause: str = "ok"  # how the rollout ended (agl_trainer.store.records.CAUSES)


@dataclass
class TrainingBatch:
    """Samples padded to [N, L] (right padding), with rollout-level structure.

    Per token [N, L]: input_ids, attention_mask, position_ids, loss_mask, engine_logprobs,
    policy_versions, token_rewards, logprob_known (bool: the engine's logprob is usable; a NaN or
    infinite engine logprob is stored as 0.0 with logprob_known False), after_switch (bool).
    Per sample [N]: rollout_index (into the rollout arrays).
    Per rollout [R]: rollout_rewards, rollout_group_index (rollouts of one task share a group).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    token_rewards: torch.Tensor
    rollout_index: torch.Tensor
    rollout_rewards: torch.Tensor
    rollout_group_index: torch.Tensor
    rollout_ids: list[str]
    task_ids: list[str]  # per rollout
    logprob_known: torch.Tensor | None = None  # None: every engine logprob is known
    after_switch: torch.Tensor | None = None  # None: no token was sampled after a keep switch

    def known_logprobs(self) -> torch.Tensor:
        """[N, L] bool: where engine_logprobs holds the engine's own (finite) logprob."""
        import torch

        finite = torch.isfinite(self.engine_logprobs)
        return finite if self.logprob_known is None else finite & self.logprob_known.bool()

    def switched(self) -> torch.Tensor:
        """[N, L] bool: tokens sampled after a keep switch over the old weights' KV."""
        import torch

        if self.after_switch is None:
            return torch.zeros(self.engine_logprobs.shape, dtype=torch.bool)
        return self.after_switch.bool()

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rollouts(self) -> int:
        return len(self.rollout_ids)

    @classmethod
    def from_rollouts(cls, rollouts: list[RolloutResult], pad_token_id: int = 0) -> TrainingBatch:
        """Pad every sample of `rollouts`; groups are formed by task id, in order of first appearance."""
        import torch
        samples = [(index, sample) for index, rollout in enumerate(rollouts) for sample in rollout.samples]
        if not samples:
            raise ValueError("TrainingBatch.from_rollouts: no samples (every rollout was empty)")
        n, width = len(samples), max(len(sample.token_ids) for _, sample in samples)
        input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        loss_mask = torch.zeros((n, width), dtype=torch.float32)
        engine_logprobs = torch.zeros((n, width), dtype=torch.float32)
        policy_versions = torch.full((n, width), -1, dtype=torch.long)
        token_rewards = torch.zeros((n, width), dtype=torch.float32)
        known = torch.ones((n, width), dtype=torch.bool)
        switched = torch.zeros((n, width), dtype=torch.bool)
        for row, (_, sample) in enumerate(samples):
            length = len(sample.token_ids)
            input_ids[row, :length] = torch.tensor(sample.token_ids, dtype=torch.long)
            attention_mask[row, :length] = 1
            loss_mask[row, :length] = torch.tensor(sample.loss_mask, dtype=torch.float32)
            engine_logprobs[row, :length] = torch.tensor(sample.engine_logprobs, dtype=torch.float32)
            policy_versions[row, :length] = torch.tensor(sample.policy_versions, dtype=torch.long)
            if sample.token_rewards is not None:
                token_rewards[row, :length] = torch.tensor(sample.token_rewards, dtype=torch.float32)
            if sample.logprob_known is not None:
                known[row, :length] = torch.tensor(sample.logprob_known, dtype=torch.bool)
            if sample.after_switch is not None:
                switched[row, :length] = torch.tensor(sample.after_switch, dtype=torch.bool)
        # NaN or +-inf from any source is unknown, never a weight: 0.0 is only a placeholder
        known &= torch.isfinite(engine_logprobs)
        engine_logprobs = torch.where(known, engine_logprobs, torch.zeros(()))
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        groups: dict[str, int] = {}
        group_index = [groups.setdefault(rollout.task_id, len(groups)) for rollout in rollouts]
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            loss_mask=loss_mask,
            engine_logprobs=engine_logprobs,
            policy_versions=policy_versions,
            token_rewards=token_rewards,
            rollout_index=torch.tensor([index for index, _ in samples], dtype=torch.long),
            rollout_rewards=torch.tensor([rollout.reward for rollout in rollouts], dtype=torch.float32),
            rollout_group_index=torch.tensor(group_index, dtype=torch.long),
            rollout_ids=[rollout.rollout_id for rollout in rollouts],
            task_ids=[rollout.task_id for rollout in rollouts],
            logprob_known=known,
            after_switch=switched,
        )
