"""`agl.emit_reward()`: attach a reward to a rollout as an `agl.reward` span."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from numbers import Real
from typing import Any

from agl import semconv
from agl.rollout import _check_text, _env_int, _parent_context, current_rollout, env_text

NO_ROLLOUT_MESSAGE = (
    "agl.emit_reward: no rollout to attribute this reward to. Call it inside `with agl.rollout(...):`, "
    "pass rollout_id=..., or run the harness under an agl runner (it sets AGL_ROLLOUT_ID)."
)

_ATTRIBUTE_TYPES = (str, bool, int, float)


class NoRolloutError(RuntimeError):
    """A reward was emitted with no rollout to attribute it to."""


def emit_reward(
    value: float | Mapping[str, float],
    *,
    name: str = semconv.DEFAULT_REWARD_NAME,
    rollout_id: str | None = None,
    call_seq: int | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Record a reward for a rollout (and, with `call_seq`, for one of its model calls: its position
    in the rollout, 0 = the first call, or its agl.call.seq).

    `value` is a finite number, or a dict of named finite numbers (one span each, named by key).
    The rollout is `rollout_id`, else the active `agl.rollout`, else the W3C baggage, else
    `AGL_ROLLOUT_ID`; with none of them it raises `NoRolloutError`.
    """
    rewards = _validate_rewards(value, name)
    if call_seq is not None and (isinstance(call_seq, bool) or not isinstance(call_seq, int) or call_seq < 0):
        raise ValueError(f"agl.emit_reward: call_seq must be an int >= 0, got {call_seq!r}")
    extra = _validate_attributes(attributes)
    if rollout_id is not None and (not isinstance(rollout_id, str) or not rollout_id):
        raise ValueError("agl.emit_reward: rollout_id must be a non-empty string")
    if rollout_id is not None:
        _check_text(rollout_id, "agl.emit_reward: rollout_id")

    identity = _identity(rollout_id)
    from agl._tracing import get_tracer

    tracer = get_tracer()
    parent = _parent_context()
    for reward_name, reward_value in rewards.items():
        span_attributes: dict[str, Any] = dict(extra)
        span_attributes.update(identity)
        span_attributes[semconv.REWARD_NAME] = reward_name
        span_attributes[semconv.REWARD_VALUE] = reward_value
        if call_seq is not None:
            span_attributes[semconv.CALL_SEQ] = call_seq
        tracer.start_span(semconv.SPAN_REWARD, context=parent, attributes=span_attributes).end()


def _validate_rewards(value: Any, name: Any) -> dict[str, float]:
    if not isinstance(name, str) or not name:
        raise ValueError("agl.emit_reward: name must be a non-empty string")
    _check_text(name, "agl.emit_reward: name")
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("agl.emit_reward: the reward dict is empty")
        return {_check_name(k): _check_number(v, k) for k, v in value.items()}
    return {name: _check_number(value, name)}


def _check_name(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"agl.emit_reward: reward names must be non-empty strings, got {key!r}")
    _check_text(key, "agl.emit_reward: a reward name")
    return key


def _check_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"agl.emit_reward: reward {name!r} must be a finite number, got {type(value).__name__} {value!r}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond a double's range (10**400)
        raise ValueError(f"agl.emit_reward: reward {name!r} is too large for a double: {value!r:.40}") from None
    if not math.isfinite(number):
        raise ValueError(f"agl.emit_reward: reward {name!r} must be finite, got {number}")
    return number


def _validate_attributes(attributes: Any) -> dict[str, Any]:
    if attributes is None:
        return {}
    if not isinstance(attributes, Mapping):
        raise TypeError("agl.emit_reward: attributes must be a mapping of str to str/int/float/bool")
    for key, item in attributes.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"agl.emit_reward: attribute names must be non-empty strings, got {key!r}")
        if not isinstance(item, _ATTRIBUTE_TYPES):
            raise TypeError(
                f"agl.emit_reward: attribute {key!r} must be str, int, float or bool, got {type(item).__name__}"
            )
        _check_text(key, "agl.emit_reward: an attribute name")
        if isinstance(item, str):
            _check_text(item, f"agl.emit_reward: attribute {key!r}")
        elif isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**63:
            raise ValueError(f"agl.emit_reward: attribute {key!r} is outside int64: {item!r:.40}")
    return dict(attributes)


def _identity(explicit_id: str | None) -> dict[str, Any]:
    """rollout id, task id and attempt, from the first source that has an id."""
    if explicit_id is not None:
        return {semconv.ROLLOUT_ID: explicit_id}
    active = current_rollout()
    if active is not None:
        identity: dict[str, Any] = {semconv.ROLLOUT_ID: active.rollout_id, semconv.ATTEMPT: active.attempt}
        if active.task_id is not None:
            identity[semconv.TASK_ID] = active.task_id
        return identity
    from opentelemetry import baggage

    from_baggage = baggage.get_baggage(semconv.BAGGAGE_ROLLOUT_ID)
    if from_baggage:
        identity = {semconv.ROLLOUT_ID: str(from_baggage)}
        task = baggage.get_baggage(semconv.BAGGAGE_TASK_ID)
        if task:
            identity[semconv.TASK_ID] = str(task)
        return identity
    env_id = env_text(semconv.ENV_ROLLOUT_ID, rollout=True)
    if env_id:
        identity = {semconv.ROLLOUT_ID: env_id, semconv.ATTEMPT: _env_int(semconv.ENV_ATTEMPT, 0)}
        task_id = env_text(semconv.ENV_TASK_ID)
        if task_id:
            identity[semconv.TASK_ID] = task_id
        return identity
    raise NoRolloutError(NO_ROLLOUT_MESSAGE)
