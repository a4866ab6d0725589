"""Harness routes: POST /rollouts/{rollout_id}/reward and /rollouts/{rollout_id}/end (also under
/attempts/{n}/): a reward or a rollout's end becomes a span."""

from __future__ import annotations

import math
from typing import TypeVar

import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar import inputs
from agl_sidecar.calls.attribution import parse_traceparent
from agl_sidecar.proxy.request import read_body
from agl_sidecar.routes.common import BodyError, bad_input, decode_body, json_reply, openai_error, sidecar_of, unauthorized


Body = TypeVar("Body", bound=msgspec.Struct)


class RewardBody(msgspec.Struct, forbid_unknown_fields=True):
    value: float | int
    name: str = semconv.DEFAULT_REWARD_NAME
    call_seq: inputs.Count | None = None
    task_id: str | None = None
    attributes: dict[str, str | inputs.Int64 | float | bool] = {}


class EndBody(msgspec.Struct, forbid_unknown_fields=True):
    status: str = semconv.STATUS_SUCCEEDED
    task_id: str | None = None
    mode: str | None = None


async def _read(request: web.Request, schema: type[Body], what: str, example: str) -> Body | web.Response:
    """The harness's body as `schema`, or the refusal to answer (401, 413, a 400 naming the field)."""
    sidecar = sidecar_of(request)
    if not sidecar.harness_authorized(request):
        return unauthorized()
    try:
        raw = await read_body(request, sidecar.config.max_body_bytes, sidecar.config.body_timeout_s)
        body: Body = decode_body(raw, schema, what)
    except inputs.BodyRefused as exc:
        return bad_input(exc)
    except BodyError as exc:
        return openai_error(400, f"{exc}; expected {example}", param=exc.param)
    return body


def _as_float(value: float) -> float:
    """A JSON number as a double; an int beyond a double's range (`1` and 400 zeros, which JSON
    allows and msgspec decodes as an int) is infinite, so refused as one."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


async def reward(request: web.Request) -> web.Response:
    body = await _read(request, RewardBody, "reward", '{"value": 1.0, "name": "reward"}')
    if isinstance(body, web.Response):
        return body
    sidecar = sidecar_of(request)
    if isinstance(body.value, bool) or not math.isfinite(_as_float(body.value)):
        return openai_error(400, f"reward value must be a finite number, got {body.value!r:.60}", param="value")
    if not body.name:
        return openai_error(400, "reward name must be a non-empty string", param="name")
    try:
        inputs.text(body.name, "name")
        inputs.short_text(body.task_id, "task_id", semconv.ROLLOUT_ID_MAX_CHARS) if body.task_id else None
        identity = sidecar.identity(request)
    except inputs.BadInput as exc:
        return bad_input(exc)
    identity.task_id = body.task_id or identity.task_id
    sidecar.recorder.reward(
        identity,
        float(body.value),
        body.name,
        body.call_seq,
        parse_traceparent(request.headers.get("traceparent")),
        dict(body.attributes),
    )
    await sidecar.exporter.sync_durable()  # --durable-spans: the reward's span is on disk before the 200
    return json_reply(200, {"rollout_id": identity.rollout_id, "name": body.name, "value": float(body.value)})


async def end_rollout(request: web.Request) -> web.Response:
    body = await _read(request, EndBody, "end", '{"status": "succeeded"}')
    if isinstance(body, web.Response):
        return body
    sidecar = sidecar_of(request)
    if body.status not in (semconv.STATUS_SUCCEEDED, semconv.STATUS_FAILED):
        return openai_error(
            400, f"status must be 'succeeded' or 'failed', got {inputs.shown_text(body.status)}", param="status"
        )
    if body.mode is not None and body.mode not in semconv.MODES:
        return openai_error(400, f"mode must be one of {list(semconv.MODES)}, got {inputs.shown_text(body.mode)}", param="mode")
    try:
        inputs.short_text(body.task_id, "task_id", semconv.ROLLOUT_ID_MAX_CHARS) if body.task_id else None
        identity = sidecar.identity(request)
    except inputs.BadInput as exc:
        return bad_input(exc)
    identity.task_id = body.task_id or identity.task_id
    identity.mode = body.mode or identity.mode
    sidecar.recorder.rollout_end(identity, body.status, parse_traceparent(request.headers.get("traceparent")))
    await sidecar.exporter.sync_durable()  # --durable-spans: the end's span is on disk before the 200
    return json_reply(200, {"rollout_id": identity.rollout_id, "status": body.status})
