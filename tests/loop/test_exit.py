"""The loop ends early one way (loop/core.py): a reason set once and raised at the next check. A stop
request or an error outranks running out of training time; running out of time still measures the
final policy, a stop request does not."""

from __future__ import annotations

import time
from typing import Any

import pytest
from agl_trainer.config import LoopConfig
from agl_trainer.loop.checkpoint import LoopState
from agl_trainer.loop.core import StopTraining, TrainingLoop


def loop(**config: Any) -> TrainingLoop:
    parts: dict[str, Any] = {name: object() for name in ("source", "data", "backend", "checkpoints")}
    return TrainingLoop(LoopConfig(**config), state=LoopState(run_id="r"), **parts)


def test_out_of_time_is_raised_with_the_final_round_still_due() -> None:
    ended = loop(max_train_s=3600.0)  # an hour: no stall of the machine reaches it
    ended._check_stop()  # within the limit: nothing
    ended._started = time.monotonic() - 7200  # two hours of training behind it
    ended._check_stop(clock=False)  # a validation round's own checks never look at the clock
    with pytest.raises(StopTraining, match="max_train_s=3600 reached") as raised:
        ended._check_stop()
    assert raised.value.final_validation


def test_a_stop_request_outranks_running_out_of_time_and_is_never_measured() -> None:
    ended = loop(max_train_s=3600.0)
    ended._started = time.monotonic() - 7200
    with pytest.raises(StopTraining):
        ended._check_stop()
    ended.request_stop()  # Ctrl-C after the limit: no final round
    with pytest.raises(StopTraining, match="stop requested") as raised:
        ended._check_stop(clock=False)
    assert not raised.value.final_validation


def test_the_first_of_a_stop_request_and_an_error_wins() -> None:
    stopped = loop()
    stopped.request_stop()
    stopped._end(RuntimeError("harness not found"))
    with pytest.raises(StopTraining, match="stop requested"):
        stopped._check_stop()
    failed = loop()
    failed._end(RuntimeError("harness not found"))
    failed.request_stop()
    with pytest.raises(RuntimeError, match="harness not found"):
        failed._check_stop()
