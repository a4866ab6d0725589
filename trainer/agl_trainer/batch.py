"""The training batch: what assembly produces and what algorithms and backends consume.

A `Sample` is one token sequence of one rollout (a rollout's calls merge into one sample when each
prompt extends the previous sequence exactly; otherwise the rollout has several samples). Tokens the
engine generated have loss_mask True; prompt tokens and tokens between merged calls (tool results,
template text) have loss_mask False. `TrainingBatch` is samples padded into tensors, plus the rollout
and group structure the rollout-level algorithms need. It does not depend on verl
(the verl backend deals its tensors to its workers itself: backends/verl/payload.py).

A sample's per-token fields are 1-D numpy arrays of fixed dtypes (PER_TOKEN), converted once where a
Sample is made or a field assigned, so padding is array copies, never a Python loop over tokens:
- token_ids int32: what the store keeps (store/rollout_store.py `<i4` blobs) and so what assembly
  holds, no copy; half int64's memory for the rollouts waiting in the buffer. The batch widens them
  to int64 (torch's embedding index) as it pads. An id int32 cannot hold is refused, never wrapped.
- loss_mask, logprob_known, after_switch bool: one byte like int8, and Python's sum() of a bool
  array counts (of an int8 one it overflows at 128).
- engine_logprobs float32: the store's `<f4` blobs and the batch's dtype, so the values the backends
  and the agreement checks compare are the engine's own, bit for bit (a list held float32 widened).
- policy_versions int64: the store's `<i8` version runs and the batch's long tensor.
- token_rewards float64: per-call rewards summed as given (as the list of Python floats did); the
  batch rounds to float32 once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch loads only where a batch is padded: assembly and `agl` config stay light
    import torch

PER_TOKEN: dict[str, np.dtype[Any]] = {
    "token_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "engine_logprobs": np.dtype(np.float32),
    "policy_versions": np.dtype(np.int64),
    "token_rewards": np.dtype(np.float64),
    "logprob_known": np.dtype(np.bool_),
    "after_switch": np.dtype(np.bool_),
}
OPTIONAL = ("token_rewards", "logprob_known", "after_switch")  # None: all 0 / all known / none switched


def per_token_array(owner: str, name: str, values: Any) -> np.ndarray:
    """`values` (a list or an array) as the 1-D array of `name`'s dtype; refused with a message
    naming the field where it is not 1-D or holds values the dtype cannot represent."""
    dtype = PER_TOKEN[name]
    try:
        array = np.asarray(values)
    except ValueError as error:  # ragged nested lists
        raise ValueError(f"Sample {owner}: {name} must be a flat list or 1-D array of numbers ({error})") from None
    if array.ndim != 1:
        raise ValueError(f"Sample {owner}: {name} must be 1-D (one value per token), got shape {array.shape}")
    if array.dtype == dtype:
        return array
    if array.size == 0:
        return np.zeros(0, dtype)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"Sample {owner}: {name} must hold numbers, got dtype {array.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):
        converted = array.astype(dtype)
    # ids, versions and masks are exact: a float, an out-of-range id or a mask value other than 0/1
    # is a caller's mistake, not something to round or wrap (floats only round: float64 -> float32)
    if dtype.kind != "f" and not np.array_equal(converted.astype(array.dtype), array):
        bad = int(np.flatnonzero(converted.astype(array.dtype) != array)[0])
        value = array[bad].item()
        raise ValueError(f"Sample {owner}: {name}[{bad}] = {value!r} is not exactly representable as {dtype}")
    return converted


@dataclass(eq=False)
class Sample:
    """One sequence of one rollout. All per-token arrays have the same length (PER_TOKEN: dtypes);
    a list is accepted and converted."""

    rollout_id: str
    task_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray  # True where the engine generated the token and it is trained
    engine_logprobs: np.ndarray  # the engine's logprob of each generated token, 0.0 elsewhere
    policy_versions: np.ndarray  # the policy version that generated each token, -1 elsewhere
    call_seqs: list[int] = field(default_factory=list)  # the calls merged into this sample, in order
    token_rewards: np.ndarray | None = None  # per-call rewards placed on a call's last token
    # False where the engine gave no usable logprob (missing, NaN): its engine_logprobs 0.0 is a
    # placeholder the backends never weigh with (backends/agreement.py re-scores or excludes). None: all known.
    logprob_known: np.ndarray | None = None
    # True where a token was sampled after a drain-free switch (loop.switch: keep) in the same call: over
    # the old weights' KV of its prefix, so it is expected to differ from the trainer's forward. None: none.
    after_switch: np.ndarray | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # every assignment converts: the constructor's, and a later one (loop/live.py masks stale tokens)
        if name in PER_TOKEN and (value is not None or name not in OPTIONAL):  # a required field's None is refused
            value = per_token_array(self.__dict__.get("rollout_id", "?"), name, value)
            if self.__dict__.get("_made"):  # checked before it is set: a refused value leaves the sample as it was
                self._check_lengths({**self.__dict__, name: value})
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self._check_lengths(self.__dict__)
        object.__setattr__(self, "_made", True)  # from now on an assignment checks the lengths too

    def _check_lengths(self, values: dict[str, Any]) -> None:
        n = values["token_ids"].size
        bad = {name: values[name].size for name in PER_TOKEN if values[name] is not None and values[name].size != n}
        if bad:
            raise ValueError(f"Sample {self.rollout_id}: token_ids has {n} tokens but {bad}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name not in PER_TOKEN:
                if mine != theirs:
                    return False
            elif (mine is None) != (theirs is None) or (
                mine is not None and not np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f")
            ):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    @property
    def num_trained_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


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

    def samples_as_rollouts(self) -> TrainingBatch:
        """The same rows with every sample its own rollout: its rollout's reward and task group, id
        `<rollout id>#<row>` (`algorithm.advantage_unit: sample`: an advantage and a rollout-level
        weight per sample). The per-token tensors are shared, not copied."""
        import torch

        owners = self.rollout_index.tolist()
        return replace(
            self,
            rollout_index=torch.arange(self.num_samples, dtype=torch.long),
            rollout_rewards=self.rollout_rewards[self.rollout_index],
            rollout_group_index=self.rollout_group_index[self.rollout_index],
            rollout_ids=[f"{self.rollout_ids[owner]}#{row}" for row, owner in enumerate(owners)],
            task_ids=[self.task_ids[owner] for owner in owners],
        )

    @classmethod
    def from_rollouts(cls, rollouts: list[RolloutResult], pad_token_id: int = 0) -> TrainingBatch:
        """Pad every sample of `rollouts`; groups are formed by task id, in order of first appearance.
        The padded [N, L] arrays are built in numpy (a row copy per sample and field, no Python loop
        over tokens) and handed to torch without a copy (torch.from_numpy)."""
        import torch

        samples = [(index, sample) for index, rollout in enumerate(rollouts) for sample in rollout.samples]
        if not samples:
            raise ValueError("TrainingBatch.from_rollouts: no samples (every rollout was empty)")
        lengths = np.fromiter((s.token_ids.size for _, s in samples), np.int64, len(samples))
        rows, width = [sample for _, sample in samples], int(lengths.max())
        input_ids = _padded(rows, "token_ids", width, np.int64, pad_token_id)
        loss_mask = _padded(rows, "loss_mask", width, np.float32, 0)
        engine_logprobs = _padded(rows, "engine_logprobs", width, np.float32, 0)
        policy_versions = _padded(rows, "policy_versions", width, np.int64, -1)
        token_rewards = _padded(rows, "token_rewards", width, np.float32, 0)
        known = _padded(rows, "logprob_known", width, np.bool_, True)
        switched = _padded(rows, "after_switch", width, np.bool_, False)
        # NaN or +-inf from any source is unknown, never a weight: 0.0 is only a placeholder
        known &= np.isfinite(engine_logprobs)
        engine_logprobs[~known] = 0.0
        attention_mask = (np.arange(width) < lengths[:, None]).astype(np.int64)
        position_ids = np.maximum(attention_mask.cumsum(axis=1) - 1, 0)
        groups: dict[str, int] = {}
        group_index = [groups.setdefault(rollout.task_id, len(groups)) for rollout in rollouts]
        return cls(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attention_mask),
            position_ids=torch.from_numpy(position_ids),
            loss_mask=torch.from_numpy(loss_mask),
            engine_logprobs=torch.from_numpy(engine_logprobs),
            policy_versions=torch.from_numpy(policy_versions),
            token_rewards=torch.from_numpy(token_rewards),
            rollout_index=torch.tensor([index for index, _ in samples], dtype=torch.long),
            rollout_rewards=torch.tensor([rollout.reward for rollout in rollouts], dtype=torch.float32),
            rollout_group_index=torch.tensor(group_index, dtype=torch.long),
            rollout_ids=[rollout.rollout_id for rollout in rollouts],
            task_ids=[rollout.task_id for rollout in rollouts],
            logprob_known=torch.from_numpy(known),
            after_switch=torch.from_numpy(switched),
        )


def _padded(samples: list[Sample], name: str, width: int, dtype: Any, fill: Any) -> np.ndarray:
    """Field `name` of every sample as one [len(samples), width] array, `fill` past each sample's end
    and where the (optional) field is None: a row copy per sample, no Python loop over tokens."""
    out = np.full((len(samples), width), fill, dtype)
    for row, sample in enumerate(samples):
        values = getattr(sample, name)
        if values is not None:
            out[row, : values.size] = values
    return out
