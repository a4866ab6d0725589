"""Benchmark: merging a rollout's calls onto the call tree.

    python bench/assembly_tree.py [--quick]

A rollout of 200 calls (4 threads interleaved, as a main thread and sub-agents make them, each
prompt extending its thread's last sequence by a tool result), contexts growing to tens of
thousands of tokens. Prints the time to find every call's parent with assembly's index (a radix
tree of the full sequences: assembly/tree.py) and with the obvious way, comparing each prompt with every earlier call's full
sequence, measured in the same run (the ratio), and the whole `assemble_rollout` time. Then the
same for naming each break's closest earlier call, with sub-agents sharing a long system prompt.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.assembly.tree import PrefixIndex
from agl_trainer.store.records import CallRow, RolloutData, RolloutInfo, RewardRow


def make_rollout(calls: int, threads: int, tool_tokens: int, completion_tokens: int) -> RolloutData:
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 150_000, 512).astype(np.int32) for _ in range(threads)]
    rows = []
    for seq in range(calls):
        t = seq % threads
        prompt = np.concatenate([sequences[t], rng.integers(0, 150_000, tool_tokens).astype(np.int32)])
        completion = rng.integers(0, 150_000, completion_tokens).astype(np.int32)
        sequences[t] = np.concatenate([prompt, completion])
        rows.append(
            CallRow(
                span_id=seq.to_bytes(8), call_seq=seq, name="chat bench", end_ns=seq, prompt_ids=prompt,
                completion_ids=completion, logprobs=np.full(completion.size, -0.5, np.float32),
                prompt_ref_seq=None, prompt_ref_length=None, prompt_length=int(prompt.size), policy_version=0,
                finish_reason="stop", end_reason="completed", tokens_source="engine",
            )  # fmt: skip
        )
    info = RolloutInfo(
        rollout_id="bench", attempt=0, task_id="t", mode="train", status="succeeded", complete=True,
        end_cause="ok", first_seen_at=0.0, last_span_at=0.0, completed_at=0.0, trained_step=None,
        dropped_reason=None,
    )  # fmt: skip
    return RolloutData(info=info, calls=rows, rewards=[RewardRow(b"\x01" * 8, "reward", 1.0, None, 1)])


Calls = list[tuple[int, np.ndarray, np.ndarray]]  # (seq, prompt, full): what assembly holds anyway


def prepared(data: RolloutData) -> Calls:
    return [(c.call_seq, c.prompt_ids, np.concatenate([c.prompt_ids, c.completion_ids])) for c in data.calls]


def parents_indexed(calls: Calls) -> list[int | None]:
    index, parents = PrefixIndex(), []
    for seq, prompt, full in calls:
        parents.append(index.parent(prompt))
        index.add(seq, full, int(prompt.size))
    return parents


def parents_linear(calls: Calls) -> list[int | None]:
    """The rule before the call tree: a call can only extend the call just before it."""
    parents: list[int | None] = []
    previous: tuple[int, np.ndarray] | None = None
    for seq, prompt, full in calls:
        extends = previous is not None and prompt.size >= previous[1].size
        extends = extends and np.array_equal(prompt[: previous[1].size], previous[1])  # type: ignore[index]
        parents.append(previous[0] if extends else None)  # type: ignore[index]
        previous = (seq, full)
    return parents


def parents_naive(calls: Calls) -> list[int | None]:
    """Every earlier full sequence compared with the prompt; the longest one it extends."""
    fulls: list[tuple[int, np.ndarray]] = []
    parents = []
    for seq, prompt, full in calls:
        best = None
        for earlier, sequence in fulls:
            if sequence.size <= prompt.size and np.array_equal(prompt[: sequence.size], sequence):
                if best is None or sequence.size > fulls[best][1].size:
                    best = earlier
        parents.append(best)
        fulls.append((seq, full))
    return parents


def shared_roots(calls: int, shared: int) -> RolloutData:
    """`calls` sub-agents that share a long system prompt and nothing else: every call is a new
    root, and assembly names each break's closest earlier call."""
    data = make_rollout(calls, threads=1, tool_tokens=1, completion_tokens=100)
    system = np.random.default_rng(1).integers(0, 150_000, shared).astype(np.int32)
    for i, call in enumerate(data.calls):
        call.prompt_ids = np.concatenate([system, np.asarray([i], np.int32)])
        call.prompt_length = int(call.prompt_ids.size)
    return data


def closest_indexed(calls: Calls) -> list[int | None]:
    index, found = PrefixIndex(), []
    for seq, prompt, full in calls:
        near = index.closest(prompt) if len(index) else None
        found.append(None if near is None else near[2])
        index.add(seq, full, int(prompt.size))
    return found


def closest_naive(calls: Calls) -> list[int | None]:
    fulls: list[np.ndarray] = []
    found: list[int | None] = []
    for _, prompt, full_sequence in calls:
        best = None
        for full in fulls:
            n = min(full.size, prompt.size)
            differ = np.flatnonzero(full[:n] != prompt[:n])
            common = int(differ[0]) if differ.size else n
            best = common if best is None else max(best, common)
        found.append(best)
        fulls.append(full_sequence)
    return found


def best_of(fn, arg, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="50 calls, 3 repeats")
    args = parser.parse_args()
    calls, repeats = (50, 3) if args.quick else (200, 5)
    data = make_rollout(calls, threads=4, tool_tokens=400, completion_tokens=100)
    tokens = sum(int(c.prompt_ids.size + c.completion_ids.size) for c in data.calls)
    calls_of = prepared(data)
    assert parents_indexed(calls_of) == parents_naive(calls_of)
    indexed = best_of(parents_indexed, calls_of, repeats)
    naive = best_of(parents_naive, calls_of, repeats)
    whole = best_of(lambda d: assemble_rollout(d, AssemblyConfig()), data, repeats)
    samples = len(assemble_rollout(data, AssemblyConfig()).result.samples)  # type: ignore[union-attr]
    longest = max(int(c.prompt_ids.size) for c in data.calls)
    print(f"{calls} calls in 4 interleaved threads, prompts up to {longest} tokens, {tokens} tokens in all")
    print(f"  parents by the radix tree:    {indexed * 1e3:8.1f} ms")
    print(f"  parents by comparing all:     {naive * 1e3:8.1f} ms   (reference)")
    print(f"  ratio (reference / index):    {naive / indexed:8.1f}x")
    print(f"  assemble_rollout, whole:      {whole * 1e3:8.1f} ms -> {samples} samples")
    line = make_rollout(calls, threads=1, tool_tokens=400, completion_tokens=100)
    line_calls = prepared(line)
    assert parents_indexed(line_calls) == parents_linear(line_calls)
    indexed = best_of(parents_indexed, line_calls, repeats)
    linear = best_of(parents_linear, line_calls, repeats)
    print(f"{calls} calls in one thread (the old rule's case), {line.calls[-1].prompt_ids.size} tokens at the end")
    print(f"  parents by the radix tree:           {indexed * 1e3:8.1f} ms")
    print(f"  the previous call only (old rule):   {linear * 1e3:8.1f} ms   (reference)")
    print(f"  ratio (reference / index):           {linear / indexed:8.2f}x")
    roots = shared_roots(calls, shared=10_000)
    root_calls = prepared(roots)
    assert closest_indexed(root_calls) == closest_naive(root_calls)
    indexed = best_of(closest_indexed, root_calls, repeats)
    naive = best_of(closest_naive, root_calls, repeats)
    print(f"{calls} sub-agents sharing a 10000-token system prompt (every call a break to classify)")
    print(f"  closest earlier call by radix tree: {indexed * 1e3:8.1f} ms")
    print(f"  closest by scanning every sequence:  {naive * 1e3:8.1f} ms   (reference)")
    print(f"  ratio (reference / index):           {naive / indexed:8.1f}x")


if __name__ == "__main__":
    main()
