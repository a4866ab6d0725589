"""Property: however spans arrive (order, batching, duplicates), assembly gives the same samples."""

from __future__ import annotations

import tempfile
from pathlib import Path

from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.store import RolloutStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span

tokens = st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=6)


@st.composite
def rollouts(draw):
    """A rollout's spans: calls that extend, reference or diverge from the previous sequence."""
    rollout_id = draw(st.sampled_from(["r-a", "r-b"]))
    spans = []
    sequence: list[int] = []
    previous = 0
    for seq in range(draw(st.integers(min_value=1, max_value=6))):
        how = "new" if seq == 0 else draw(st.sampled_from(["extend", "reference", "diverge", "absent"]))
        completion = draw(tokens)
        if how == "absent":
            spans.append(call_span(rollout_id, seq, [], [], tokens_source="absent"))
            continue
        if how in ("extend", "reference"):
            suffix = draw(st.lists(st.integers(min_value=0, max_value=50_000), max_size=3))
            prompt = sequence + suffix
        else:
            prompt = draw(tokens)
        if how == "reference":
            spans.append(
                call_span(
                    rollout_id,
                    seq,
                    suffix,
                    completion,
                    ref=(previous, len(sequence)),
                    prompt_length=len(prompt),
                    version=seq,
                )
            )
        else:
            spans.append(call_span(rollout_id, seq, prompt, completion, version=seq))
        sequence, previous = prompt + completion, seq
    for index in range(draw(st.integers(min_value=0, max_value=3))):
        value = draw(st.floats(min_value=-1, max_value=1))
        end_ns = draw(st.integers(min_value=1, max_value=5))  # ties are broken by span id
        spans.append(reward_span(rollout_id, value, end_ns=end_ns))
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        call = draw(st.integers(min_value=0, max_value=6))
        spans.append(reward_span(rollout_id, draw(st.floats(min_value=-1, max_value=1)), call_seq=call))
    spans.append(rollout_span(rollout_id))
    return spans


@st.composite
def arrivals(draw, spans):
    """A permutation of the spans, cut into requests, some spans sent twice."""
    order = draw(st.permutations(spans))
    resent = draw(st.lists(st.sampled_from(spans), max_size=3))
    order = list(order) + resent
    cuts = sorted(draw(st.lists(st.integers(min_value=1, max_value=len(order)), max_size=3)))
    batches, start = [], 0
    for cut in [*cuts, len(order)]:
        if cut > start:
            batches.append(order[start:cut])
            start = cut
    return batches


def _assemble(path: Path, batches) -> list:
    config = AssemblyConfig(missing_reward=0.0)
    with RolloutStore(path, grace_s=0.0) as store:
        for batch in batches:
            ingest(store, batch)
        result = assemble(store, store.ready_rollouts(), config)
        return [result.rollouts, result.report]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_any_arrival_order_gives_the_same_samples(data):
    spans = data.draw(rollouts())
    batches = data.draw(arrivals(spans))
    with tempfile.TemporaryDirectory() as directory:
        in_order = _assemble(Path(directory) / "a.db", [spans])
        shuffled = _assemble(Path(directory) / "b.db", batches)
    assert shuffled == in_order
    assert in_order[0], "every generated rollout has at least one trainable call"
