"""Assembly grows with a rollout's new tokens, not with its calls times its context: a 20,000-call
rollout assembles, and the call tree's counted work (tokens compared + nodes visited) for 8,000
calls is about 4x that for 2,000 (it was quadratic: 16x, and nothing at 20,000 in 120 s). The
parents and closest calls it finds equal a brute-force search on a smaller mixed rollout."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.assembly.tree import PrefixIndex
from agl_trainer.store.records import CallRow, RewardRow, RolloutData, RolloutInfo

# the module, not the package's `assemble` function of the same name
assemble_module = importlib.import_module("agl_trainer.assembly.assemble")


def _row(seq: int, prompt: np.ndarray, completion: np.ndarray, ref: tuple[int, int] | None) -> CallRow:
    return CallRow(
        span_id=seq.to_bytes(8, "big"), call_seq=seq, name="chat", end_ns=seq, prompt_ids=prompt,
        completion_ids=completion, logprobs=np.full(completion.size, -0.5, np.float32),
        prompt_ref_seq=None if ref is None else ref[0], prompt_ref_length=None if ref is None else ref[1],
        prompt_length=None, policy_version=0, finish_reason="stop", end_reason="completed", tokens_source="engine",
    )  # fmt: skip


def mixed_rollout(calls: int, seed: int = 0, retry_every: int = 70) -> RolloutData:
    """A main thread whose prompts extend its last call by reference (as the sidecar records them),
    with a sub-agent started from the system prompt every 50 calls (a break to name) and a retry
    of the last call every `retry_every` (a branch)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(5, 1000, 32).astype(np.int32)
    rows: list[CallRow] = []
    length = {}  # seq -> full length
    last: int | None = None
    for seq in range(calls):
        completion = rng.integers(5, 1000, 8).astype(np.int32)
        if last is None or seq % 50 == 25:
            prompt, ref = np.concatenate([system, rng.integers(5, 1000, 4).astype(np.int32)]), None
        elif seq % retry_every == retry_every - 1:  # the last call again, another answer
            previous = rows[last]
            prompt, ref = previous.prompt_ids, (None if previous.prompt_ref_seq is None else
                                                (previous.prompt_ref_seq, previous.prompt_ref_length))  # fmt: skip
        else:
            prompt, ref = rng.integers(5, 1000, 4).astype(np.int32), (last, length[last])
        rows.append(_row(seq, prompt, completion, ref))
        length[seq] = (0 if ref is None else ref[1]) + int(prompt.size) + int(completion.size)
        if seq % 50 != 25 and seq % retry_every != retry_every - 1:
            last = seq
    info = RolloutInfo(
        rollout_id="big", attempt=0, task_id="t", mode="train", status="succeeded", complete=True,
        end_cause="ok", first_seen_at=0.0, last_span_at=0.0, completed_at=0.0, trained_step=None,
        dropped_reason=None,
    )  # fmt: skip
    return RolloutData(info=info, calls=rows, rewards=[RewardRow(b"\x01" * 8, "reward", 1.0, None, 1)])


def counted(data: RolloutData, monkeypatch: pytest.MonkeyPatch):
    made: list[PrefixIndex] = []

    class Counted(PrefixIndex):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(assemble_module, "PrefixIndex", Counted)
    assembly = assemble_rollout(data, AssemblyConfig())
    return assembly, made[0].operations


def test_the_call_tree_work_grows_linearly_with_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each retry of the main thread is a branch point the thread then grows below (one level
    # deeper): a fixed number of them here, so the count isolates the growth with calls.
    small, small_ops = counted(mixed_rollout(2_000, retry_every=200), monkeypatch)
    large, large_ops = counted(mixed_rollout(8_000, retry_every=800), monkeypatch)
    assert small.problems == {} and large.problems == {}
    assert 3.0 < large_ops / small_ops < 5.0, (small_ops, large_ops)  # linear: 4; quadratic: 16


@pytest.mark.slow
def test_a_20000_call_rollout_assembles_with_every_call_placed() -> None:
    data = mixed_rollout(20_000, retry_every=200)
    assembly = assemble_rollout(data, AssemblyConfig())
    assert assembly.result is not None and assembly.problems == {}
    placements = assembly.placements
    assert len(placements) == 20_000 and all(p.sample is not None for p in placements)
    starts = [p.call_seq for p in placements if not p.merged]
    assert starts == [0] + [s for s in range(1, 20_000) if s % 50 == 25 or s % 200 == 199]
    # the main thread is one sample: every merged call's parent is the main thread's previous call
    main = [p for p in placements if p.sample == placements[0].sample]
    assert all(p.parent == q.call_seq for q, p in zip(main, main[1:], strict=False))
    # a sub-agent's break is named against a main-thread call sharing its system prompt (32 tokens)
    positions = {f.position for f in assembly.merge_failures if f.call_seq % 50 == 25}
    assert min(positions) == 32 and max(positions) < 36


def brute_parent(prompt: np.ndarray, fulls: list[tuple[int, np.ndarray]]) -> int | None:
    best = None
    for seq, full in fulls:  # the longest, the earliest of equal ones
        if full.size <= prompt.size and np.array_equal(prompt[: full.size], full):
            if best is None or full.size > best[1]:
                best = (seq, full.size)
    return None if best is None else best[0]


def brute_closest(prompt: np.ndarray, fulls: list[tuple[int, np.ndarray]]) -> tuple[int, int]:
    best = (-1, -1)
    for seq, full in fulls:  # the longest common prefix, the latest of equal ones
        n = min(full.size, prompt.size)
        differ = np.flatnonzero(full[:n] != prompt[:n])
        common = int(differ[0]) if differ.size else n
        if common >= best[1]:
            best = (seq, common)
    return best


def test_parents_and_closest_calls_equal_a_brute_force_search() -> None:
    rng = np.random.default_rng(3)
    fulls: list[tuple[int, np.ndarray]] = []
    index = PrefixIndex()
    for seq in range(400):
        if fulls and rng.random() < 0.8:  # extend, or cut and change, an earlier sequence
            _, base = fulls[int(rng.integers(len(fulls)))]
            cut = int(rng.integers(0, base.size + 1)) if rng.random() < 0.4 else base.size
            prompt = np.concatenate([base[:cut], rng.integers(0, 4, int(rng.integers(0, 4)))])
        else:
            prompt = rng.integers(0, 4, int(rng.integers(0, 6)))
        full = np.concatenate([prompt, rng.integers(0, 4, int(rng.integers(0, 3)))])
        parent = index.parent(prompt)
        assert parent == brute_parent(prompt, fulls)
        if fulls:
            seq_near, _, common = index.closest(prompt)  # type: ignore[misc]
            assert (seq_near, common) == brute_closest(prompt, fulls)
        index.add(seq, full, int(prompt.size), None if parent is None else (parent, int(prompt.size)))
        fulls.append((seq, full))
