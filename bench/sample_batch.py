"""Benchmark: stored calls -> samples -> padded TrainingBatch, samples as numpy arrays against lists.

    python bench/sample_batch.py [--rollouts 64] [--min-tokens 4096] [--max-tokens 32768] [--repeats 5] [--quick]

`rollouts` rollouts of one thread of 8 calls each (every prompt extending the previous call's
sequence by a tool result: one merged sample), 4k-32k tokens a rollout. Times, best of `repeats`:
  arrays: assemble_rollout, then TrainingBatch.from_rollouts (samples hold numpy arrays; padding is
          a row copy per sample and field, torch.from_numpy once per tensor);
  lists:  the reference, the way before #41, kept here: the same assembly ending in `.tolist()` of
          every per-token array into a list-holding sample, then the old from_rollouts, one
          `torch.tensor(list)` per sample and field.
Both batches are checked equal, tensor for tensor, before anything is timed.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.batch import RolloutResult, TrainingBatch
from agl_trainer.store.records import CallRow, RolloutData, RolloutInfo, RewardRow

CALLS = 8  # a rollout's calls, one thread


def make_rollout(index: int, tokens: int, rng: np.random.Generator) -> RolloutData:
    """One thread of CALLS calls whose full sequences end at `tokens`: a 1k-token system prompt, then
    per call a tool result (context) and a completion (trained), about a third of each turn trained."""
    turn = (tokens - 1024) // CALLS
    completion_size = max(1, turn // 3)
    sequence = rng.integers(0, 150_000, 1024).astype(np.int32)
    rows = []
    for seq in range(CALLS):
        tool = rng.integers(0, 150_000, turn - completion_size).astype(np.int32)
        prompt = np.concatenate([sequence, tool])
        completion = rng.integers(0, 150_000, completion_size).astype(np.int32)
        logprobs = -rng.exponential(1.0, completion_size).astype(np.float32)
        sequence = np.concatenate([prompt, completion])
        rows.append(
            CallRow(
                span_id=seq.to_bytes(8), call_seq=seq, name="chat bench", end_ns=seq, prompt_ids=prompt,
                completion_ids=completion, logprobs=logprobs, prompt_ref_seq=None, prompt_ref_length=None,
                prompt_length=int(prompt.size), policy_version=seq // 4, finish_reason="stop",
                end_reason="completed", tokens_source="engine",
            )  # fmt: skip
        )
    info = RolloutInfo(
        rollout_id=f"r{index}", attempt=0, task_id=f"t{index // 8}", mode="train", status="succeeded",
        complete=True, end_cause="ok", first_seen_at=0.0, last_span_at=0.0, completed_at=0.0,
        trained_step=None, dropped_reason=None,
    )  # fmt: skip
    return RolloutData(info=info, calls=rows, rewards=[RewardRow(b"\x01" * 8, "reward", float(index % 2), None, 1)])


# ------------------------------------------------------------------ the reference: lists (before #41)
@dataclass
class ListSample:
    """Sample as it was: Python lists per token, lengths checked."""

    rollout_id: str
    task_id: str
    token_ids: list[int]
    loss_mask: list[int]
    engine_logprobs: list[float]
    policy_versions: list[int]
    call_seqs: list[int] = field(default_factory=list)
    token_rewards: list[float] | None = None
    logprob_known: list[int] | None = None
    after_switch: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for values in (self.loss_mask, self.engine_logprobs, self.policy_versions, self.token_rewards,
                       self.logprob_known, self.after_switch):  # fmt: skip
            assert values is None or len(values) == n


def as_lists(result: RolloutResult) -> RolloutResult:
    """What assembly's `_finish_samples` made before #41: every array `.tolist()`ed (int8 masks)."""
    samples = [
        ListSample(
            s.rollout_id, s.task_id, s.token_ids.tolist(), s.loss_mask.astype(np.int8).tolist(),
            s.engine_logprobs.tolist(), s.policy_versions.tolist(), s.call_seqs,
            None if s.token_rewards is None else s.token_rewards.tolist(),
            None if s.logprob_known is None else s.logprob_known.astype(np.int8).tolist(),
            None if s.after_switch is None else s.after_switch.astype(np.int8).tolist(),
        )  # fmt: skip
        for s in result.samples
    ]
    return RolloutResult(result.rollout_id, result.task_id, result.reward, samples)  # type: ignore[arg-type]


def lists_from_rollouts(rollouts: list[RolloutResult], pad_token_id: int = 0) -> TrainingBatch:
    """TrainingBatch.from_rollouts before #41, verbatim but for the class it builds."""
    samples = [(index, sample) for index, rollout in enumerate(rollouts) for sample in rollout.samples]
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
    known &= torch.isfinite(engine_logprobs)
    engine_logprobs = torch.where(known, engine_logprobs, torch.zeros(()))
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    groups: dict[str, int] = {}
    group_index = [groups.setdefault(rollout.task_id, len(groups)) for rollout in rollouts]
    return TrainingBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, loss_mask=loss_mask,
        engine_logprobs=engine_logprobs, policy_versions=policy_versions, token_rewards=token_rewards,
        rollout_index=torch.tensor([index for index, _ in samples], dtype=torch.long),
        rollout_rewards=torch.tensor([rollout.reward for rollout in rollouts], dtype=torch.float32),
        rollout_group_index=torch.tensor(group_index, dtype=torch.long),
        rollout_ids=[rollout.rollout_id for rollout in rollouts], task_ids=[rollout.task_id for rollout in rollouts],
        logprob_known=known, after_switch=switched,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ measuring
def assemble_all(data: list[RolloutData], config: AssemblyConfig) -> list[RolloutResult]:
    return [assemble_rollout(d, config).result for d in data]  # type: ignore[misc]


def run_arrays(data: list[RolloutData], config: AssemblyConfig) -> tuple[float, float, TrainingBatch]:
    start = time.perf_counter()
    results = assemble_all(data, config)
    assembled = time.perf_counter()
    batch = TrainingBatch.from_rollouts(results)
    return assembled - start, time.perf_counter() - assembled, batch


def run_lists(data: list[RolloutData], config: AssemblyConfig) -> tuple[float, float, TrainingBatch]:
    start = time.perf_counter()
    results = [as_lists(r) for r in assemble_all(data, config)]
    assembled = time.perf_counter()
    batch = lists_from_rollouts(results)
    return assembled - start, time.perf_counter() - assembled, batch


def same(a: TrainingBatch, b: TrainingBatch) -> bool:
    tensors = [name for name, value in vars(a).items() if isinstance(value, torch.Tensor)]
    pairs = [(getattr(a, name), getattr(b, name)) for name in tensors]
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8 rollouts of 2k-4k tokens, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.min_tokens, args.max_tokens, args.repeats = 8, 2048, 4096, 2
    torch.set_num_threads(1)  # numpy copies on one thread: the reference's torch ops get one too
    rng = np.random.default_rng(0)
    sizes = rng.integers(args.min_tokens, args.max_tokens + 1, args.rollouts)
    data = [make_rollout(i, int(n), rng) for i, n in enumerate(sizes)]
    config = AssemblyConfig()
    arrays, lists = run_arrays(data, config), run_lists(data, config)
    if not same(arrays[2], lists[2]):
        raise SystemExit("the two batches differ: the benchmark compares nothing")
    best_arrays, best_lists = [float("inf")] * 2, [float("inf")] * 2
    for _ in range(args.repeats):  # interleaved: a load change on the shared machine hits both
        a, b = run_arrays(data, config), run_lists(data, config)
        best_arrays = [min(x, y) for x, y in zip(best_arrays, a[:2])]
        best_lists = [min(x, y) for x, y in zip(best_lists, b[:2])]
    batch = arrays[2]
    lengths = batch.attention_mask.sum(dim=1)
    print(f"{args.rollouts} rollouts of {CALLS} calls (one sample each), {int(lengths.min())}-{int(lengths.max())} "
          f"tokens each, {int(lengths.sum())} in all, best of {args.repeats}")  # fmt: skip
    print(f"{'':22}{'arrays':>10}{'lists (ref)':>14}{'lists / arrays':>16}")
    for label, index in (("assembly", 0), ("from_rollouts", 1)):
        print(f"  {label:20}{best_arrays[index] * 1e3:8.1f} ms{best_lists[index] * 1e3:11.1f} ms"
              f"{best_lists[index] / best_arrays[index]:14.1f}x")  # fmt: skip
    total_a, total_l = sum(best_arrays), sum(best_lists)
    print(f"  {'both':20}{total_a * 1e3:8.1f} ms{total_l * 1e3:11.1f} ms{total_l / total_a:14.1f}x")


if __name__ == "__main__":
    main()
