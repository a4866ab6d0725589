"""Every public SDK function rejects bad input with the documented, explanatory error."""

from __future__ import annotations

import math

import pytest

import agl
from agl import semconv


@pytest.fixture(autouse=True)
def no_runner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (semconv.ENV_ROLLOUT_ID, semconv.ENV_TASK_ID, semconv.ENV_ATTEMPT, semconv.ENV_MODE):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, {"reward": math.nan}])
def test_non_finite_rewards_are_value_errors(value: object) -> None:
    with pytest.raises(ValueError, match="finite"):
        agl.emit_reward(value, rollout_id="r")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["1.0", True, None, [1.0], {"reward": "x"}, {"reward": False}])
def test_non_numeric_rewards_are_type_errors(value: object) -> None:
    with pytest.raises(TypeError, match="finite number"):
        agl.emit_reward(value, rollout_id="r")  # type: ignore[arg-type]


def test_other_bad_reward_arguments() -> None:
    with pytest.raises(ValueError, match="empty"):
        agl.emit_reward({}, rollout_id="r")
    with pytest.raises(TypeError, match="names"):
        agl.emit_reward({1: 1.0}, rollout_id="r")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="name"):
        agl.emit_reward(1.0, name="", rollout_id="r")
    with pytest.raises(ValueError, match="call_seq"):
        agl.emit_reward(1.0, rollout_id="r", call_seq=-1)
    with pytest.raises(TypeError, match="attribute 'bad'"):
        agl.emit_reward(1.0, rollout_id="r", attributes={"bad": [1, 2]})
    with pytest.raises(ValueError, match="rollout_id"):
        agl.emit_reward(1.0, rollout_id="")


def test_reward_outside_any_rollout_says_how_to_give_one() -> None:
    with pytest.raises(agl.NoRolloutError) as error:
        agl.emit_reward(1.0)
    message = str(error.value)
    assert "agl.rollout" in message and "rollout_id=" in message and "AGL_ROLLOUT_ID" in message


def test_bad_rollout_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        agl.rollout(mode="training")
    with pytest.raises(ValueError, match="attempt"):
        agl.rollout(attempt=-1)
    with pytest.raises(ValueError, match="'/'"):
        agl.rollout(rollout_id="a/b")
    with pytest.raises(ValueError, match="http"):
        agl.rollout(rollout_id="r").base_url("localhost:8000")


def test_bad_attempt_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(semconv.ENV_ATTEMPT, "first")
    with pytest.raises(ValueError, match="AGL_ATTEMPT"):
        agl.rollout()


def test_a_rollout_cannot_be_entered_twice_at_once() -> None:
    r = agl.rollout(rollout_id="twice")
    with r:
        with pytest.raises(RuntimeError, match="already active"):
            r.__enter__()


def test_bad_init_arguments() -> None:
    with pytest.raises(ValueError, match="http"):
        agl.init(endpoint="localhost:4318")
    with pytest.raises(TypeError, match="endpoint"):
        agl.init(endpoint=4318)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="headers"):
        agl.init(endpoint="http://127.0.0.1:4318", headers={"a": 1})  # type: ignore[dict-item]
