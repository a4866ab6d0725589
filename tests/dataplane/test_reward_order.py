"""Which reward wins when a rollout gets several of one name: the one that ended last, where a
reward cannot have ended after the receiver got it. A reward dated in the future (2^63 - 1, a broken
clock, a forged record) counts as arrived when it arrived, so a correction sent after it wins; a
reward with no time counts as ended when it arrived, so untimed rewards are ordered by arrival (in a
request, by position). Before, a record dated 2^63 - 1 beat every later correction, and untimed
records tied (the span id decided)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from google.protobuf import json_format

from tests.dataplane.otlp import request, reward_span
from tests.dataplane.test_evaluation_events import logs_request, record, rewards, score
from tests.dataplane.test_hostile_input import post

FOREVER = 2**63 - 1


def _send(receiver, *spans) -> None:
    reply = post(receiver, request(spans).SerializeToString())
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("claimed", [FOREVER, 2**64 - 1, time.time_ns() + 86_400 * 10**9])
def test_a_reward_dated_in_the_future_loses_to_a_correction_sent_after_it(receiver, claimed):
    _send(receiver, reward_span("r", 1.0, start_ns=claimed - 1, end_ns=claimed))
    _send(receiver, reward_span("r", 0.5, start_ns=time.time_ns(), end_ns=time.time_ns()))  # the correction
    assert rewards(receiver, "r") == {"reward": 0.5}


def test_a_reward_from_the_past_arriving_late_does_not_beat_a_later_one(receiver):
    now = time.time_ns()
    _send(receiver, reward_span("r", 0.5, start_ns=now, end_ns=now))
    _send(receiver, reward_span("r", 1.0, start_ns=now - 10**9, end_ns=now - 10**9))  # older, retried late
    assert rewards(receiver, "r") == {"reward": 0.5}


def test_untimed_rewards_are_ordered_by_arrival(receiver):
    _send(receiver, reward_span("r", 0.1, start_ns=0, end_ns=0), reward_span("r", 0.2, start_ns=0, end_ns=0))
    assert rewards(receiver, "r") == {"reward": 0.2}  # the later in the request
    _send(receiver, reward_span("r", 0.3, start_ns=0, end_ns=0))
    assert rewards(receiver, "r") == {"reward": 0.3}
    for value in (0.9, 0.4):  # the same, whatever the span ids (random each time) say
        _send(receiver, reward_span("s", value, start_ns=0, end_ns=0))
    assert rewards(receiver, "s") == {"reward": 0.4}


def test_an_evaluation_event_dated_forever_loses_to_a_later_one(receiver):
    forever = lambda: logs_request(record(score("e", 1.0), time=FOREVER))  # noqa: E731
    later = lambda: logs_request(record(score("e", 0.25), time=time.time_ns()))  # noqa: E731 (dated once sent)
    for message in (forever, later):
        body = json.dumps(json_format.MessageToDict(message())).encode()
        reply = httpx.post(f"{receiver.url}/v1/logs", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 200
    assert rewards(receiver, "e") == {"reward": 0.25}
    untimed = logs_request(record(score("e", 0.75), time=0))
    assert httpx.post(f"{receiver.url}/v1/logs", content=untimed.SerializeToString(),
                      headers={"content-type": "application/x-protobuf"}).status_code == 200  # fmt: skip
    assert rewards(receiver, "e") == {"reward": 0.75}  # no time: as it arrived, after the others


def test_the_stored_time_of_such_a_reward_is_its_arrival(receiver, store):
    before = time.time_ns()
    _send(receiver, reward_span("t", 1.0, start_ns=FOREVER - 1, end_ns=FOREVER))
    (row,) = store.load("t").rewards
    assert before <= row.end_ns <= time.time_ns()
