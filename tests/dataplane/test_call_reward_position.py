"""A per-call reward's agl.call.seq names its call by seq or, where no seq can be mistaken for one,
by position (0 = the rollout's first call): the sidecar's seqs are clock readings (docs/spans.md
"Call numbers") while a harness counts its calls."""

from __future__ import annotations

from agl_trainer.assembly import assemble

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span

CLOCK = 459_867_340_800_000_012  # a sidecar's seq (us << 8 | instance)


def _rewards(store, seqs: list[int], rewarded: int) -> tuple[list[float] | None, dict[str, int]]:
    spans = [call_span("r", seqs[0], [1, 2], [3, 4]), call_span("r", seqs[1], [1, 2, 3, 4, 5], [6, 7, 8])]
    ingest(store, [*spans, reward_span("r", 1.0), reward_span("r", 0.5, call_seq=rewarded), rollout_span("r")])
    result = assemble(store, store.ready_rollouts())
    [sample] = result.rollouts[0].samples
    return None if sample.token_rewards is None else sample.token_rewards.tolist(), result.report.call_problems


def test_by_position_when_seqs_are_clock_readings(store) -> None:
    rewards, problems = _rewards(store, [CLOCK, CLOCK + 256], 1)
    assert rewards == [0, 0, 0, 0, 0, 0, 0, 0.5] and problems == {}


def test_by_seq_as_well(store) -> None:
    rewards, problems = _rewards(store, [CLOCK, CLOCK + 256], CLOCK)
    assert rewards == [0, 0, 0, 0.5, 0, 0, 0, 0] and problems == {}


def test_a_gap_in_counted_seqs_is_not_read_as_a_position(store) -> None:
    """Seqs 1 and 2 (call 0 lost): a reward for seq 0 is lost, not given to the call at position 0."""
    rewards, problems = _rewards(store, [1, 2], 0)
    assert rewards is None and problems == {"call_reward_lost": 1}
