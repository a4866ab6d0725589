"""Admin routes for the trainer: /agl/v1/pause, /agl/v1/resume, /agl/v1/state, /agl/v1/flush (bearer
token, or loopback with none configured); /healthz and /metrics for operators."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from aiohttp import web

from agl_sidecar import inputs
from agl_sidecar.proxy.request import read_body
from agl_sidecar.proxy.routing import validate_upstream
from agl_sidecar.calls.switches import MAX_PROGRESS, MAX_PROGRESS_ID_CHARS
from agl_sidecar.config import is_loopback
from agl_sidecar.routes.common import decode_body, json_reply, sidecar_of
from agl_sidecar.sidecar import Sidecar, same_secret


log = logging.getLogger("agl_sidecar.admin")

MAX_PAUSE_TIMEOUT_S = 7 * 24 * 3600.0  # an event loop timer takes no more
Body = TypeVar("Body", bound=msgspec.Struct)


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    drain: bool = False
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_PAUSE_TIMEOUT_S)] = 60.0
    # "drain" = drain: true. "keep": the engine freezes the calls in flight (a drain-free switch):
    # hold new calls, wait for none, deliver the spans of the calls already finished.
    mode: Literal["drain", "keep"] | None = None


class FlushBody(msgspec.Struct, forbid_unknown_fields=True):
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_PAUSE_TIMEOUT_S)] = 30.0


class ResumeBody(msgspec.Struct, forbid_unknown_fields=True):
    policy_version: inputs.Count | None = None
    upstreams: list[str] | None = None
    # A drain-free switch: the calls in flight continue under policy_version; engine_progress (engine
    # request id -> completion tokens generated before the freeze) places the boundary in each.
    switch: bool = False
    engine_progress: dict[str, inputs.Count] | None = None


def admin_only(handler: Any) -> Any:
    """Admin endpoints need the bearer token, or with none configured a loopback client (a check
    on these routes only: model calls pay nothing for it)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sidecar = sidecar_of(request)
        token = sidecar.config.admin_token
        if token:
            given = request.headers.get("Authorization", "")
            if not (given[:7].lower() == "bearer " and same_secret(given[7:].strip(), token)):
                return json_reply(401, {"error": "admin API: send 'Authorization: Bearer <admin token>' (--admin-token)"})
        elif not (request.remote and is_loopback(request.remote)):
            return json_reply(
                403, {"error": "admin API: no --admin-token is configured, so only loopback clients may use it"}
            )
        return await handler(request)

    return guarded


async def _read(request: web.Request, sidecar: Sidecar, schema: type[Body], what: str, example: str) -> Body | web.Response:
    """The admin body as `schema`, or the refusal to answer (413, a 400 with the expected shape)."""
    try:
        raw = await read_body(request, sidecar.config.max_body_bytes, sidecar.config.body_timeout_s)
        body: Body = decode_body(raw, schema, what)
    except inputs.BodyRefused as exc:
        return json_reply(exc.status, {"error": exc.message})
    except ValueError as exc:
        return json_reply(400, {"error": f"{exc}; expected {example}"})
    return body


async def pause(request: web.Request) -> web.Response:
    sidecar = sidecar_of(request)
    body = await _read(request, sidecar, PauseBody, "pause", '{"drain": true, "timeout_s": 60}')
    if isinstance(body, web.Response):
        return body
    if body.timeout_s <= 0:
        return json_reply(400, {"error": "pause: timeout_s must be > 0"})
    if body.mode == "keep" and body.drain:
        return json_reply(400, {"error": 'pause: mode "keep" does not drain; send {"mode": "keep"} without "drain": true'})
    drain = body.drain or body.mode == "drain"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.timeout_s
    sidecar.gate.pause()
    if not drain and body.mode != "keep":
        return json_reply(200, _short_state(sidecar))
    if drain and not await sidecar.gate.drain(body.timeout_s):
        state = _short_state(sidecar)
        state["error"] = f"in-flight calls did not finish within {body.timeout_s:g} s; the sidecar stays paused"
        return json_reply(504, state)
    # A drained pause also delivers the drained calls' spans (built off the calls' path, so maybe not
    # sent yet): the trainer assembles its batch right after it, and a rollout whose call spans are
    # missing then would be dropped as having no samples.
    # spans_flushed: acknowledged by the endpoint, not merely spooled (the trainer reads them from there).
    # A keep pause delivers the spans of the calls that finished; the frozen ones end later.
    spans_flushed = await sidecar.flush_spans(max(deadline - loop.time(), 1.0))
    return json_reply(200, {**_short_state(sidecar), "spans_flushed": spans_flushed, **_span_counts(sidecar)})


def _span_counts(sidecar: Sidecar) -> dict[str, int]:
    """Where the spans not yet acknowledged are, for a pause's or a flush's answer."""
    counters = sidecar.exporter.counters
    return {
        "spans_building": sidecar.recorder.backlog,
        "spans_pending": counters.spans_pending,
        "spans_sending": counters.spans_sending,
        "spans_in_spool": counters.spans_in_spool,
        "spans_dead_lettered": counters.spans_dead_lettered,
        "spans_failed": counters.spans_failed,
    }


async def flush(request: web.Request) -> web.Response:
    """Deliver the spans of every call finished so far, holding no call (a pause's delivery without
    the pause): the trainer reads a set of finished rollouts (a validation round, `agl eval`) while
    other calls go on. `spans_flushed: true` once, at one moment, nothing was queued, unbuilt or in
    the spool: every span of a call finished before the request was then acknowledged by the
    endpoint (or dead-lettered). False: not within `timeout_s` (the endpoint down, or traffic that
    never let the queue empty); the counts say how many are still on the way."""
    sidecar = sidecar_of(request)
    body = await _read(request, sidecar, FlushBody, "flush", '{"timeout_s": 30}')
    if isinstance(body, web.Response):
        return body
    spans_flushed = await sidecar.flush_spans(body.timeout_s)
    return json_reply(200, {**_short_state(sidecar), "spans_flushed": spans_flushed, **_span_counts(sidecar)})


async def resume(request: web.Request) -> web.Response:
    """Open the gate, with what the body asks. A body refused (400, 408, 413) still opens it, under
    the policy version in force: the caller meant to resume, and harness calls must not wait
    max_hold_s for a 503 because a trainer sent a malformed request; the caller gets the error
    (the trainer stops its run), and a corrected resume sets the version from then on."""
    sidecar = sidecar_of(request)
    answer = await _resume(request, sidecar)
    if answer.status >= 400 and sidecar.gate.paused:
        sidecar.gate.resume()
        log.warning("agl-sidecar: a resume was refused (HTTP %d); the gate is open under policy version %d",
                    answer.status, sidecar.gate.policy_version)
        refusal = msgspec.json.decode(answer.body)  # type: ignore[arg-type]
        return json_reply(answer.status, {**_short_state(sidecar), **refusal})
    return answer


async def _resume(request: web.Request, sidecar: Sidecar) -> web.Response:
    body = await _read(
        request, sidecar, ResumeBody, "resume",
        '{"policy_version": 3, "upstreams": ["http://..."], "switch": true, "engine_progress": {"chatcmpl-x": 17}}',
    )
    if isinstance(body, web.Response):
        return body
    if body.switch and body.policy_version is None:
        return json_reply(400, {"error": "resume: switch needs the policy_version the frozen calls continue under"})
    if body.switch and body.policy_version is not None and body.policy_version < sidecar.gate.policy_version:
        return json_reply(400, {"error": (
            f"resume: a switch continues the frozen calls under a newer version, and policy_version "
            f"{body.policy_version} is below the version in force ({sidecar.gate.policy_version}); to start a "
            'new run at a lower version, pause with {"drain": true} and resume without "switch"'
        )})
    progress = body.engine_progress
    if progress is not None and (
        len(progress) > MAX_PROGRESS or any(len(key) > MAX_PROGRESS_ID_CHARS for key in progress)
    ):
        return json_reply(400, {"error": (
            f"resume: engine_progress holds at most {MAX_PROGRESS} engine request ids of at most "
            f"{MAX_PROGRESS_ID_CHARS} characters each (got {len(progress)})"
        )})
    if body.engine_progress is not None and not body.switch:
        return json_reply(400, {"error": 'resume: engine_progress belongs to a switch; add "switch": true'})
    if body.upstreams is not None:
        if not body.upstreams:
            return json_reply(400, {"error": "resume: upstreams must not be empty"})
        for url in body.upstreams:
            problem = validate_upstream(url)
            if problem:
                return json_reply(400, {"error": f"resume: {problem}"})
        sidecar.router.set_urls(body.upstreams)
    sidecar.gate.resume(body.policy_version, body.switch, body.engine_progress)
    return json_reply(200, _short_state(sidecar))


async def state(request: web.Request) -> web.Response:
    return json_reply(200, sidecar_of(request).state())


def _short_state(sidecar: Sidecar) -> dict[str, Any]:
    gate = sidecar.gate
    return {"paused": gate.paused, "in_flight": gate.in_flight, "held": gate.held, "policy_version": gate.policy_version}


async def healthz(request: web.Request) -> web.Response:
    return json_reply(200, {"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    sidecar = sidecar_of(request)
    gate = sidecar.gate
    gauges = {
        "in_flight": gate.in_flight,
        "held": gate.held,
        "paused": int(gate.paused),
        "policy_version": gate.policy_version,
        "healthy_upstreams": sum(1 for u in sidecar.router.upstreams if u.healthy),
        "engine_connections_idle": sidecar.engines.idle_connections,
    }
    exporter = {k: v for k, v in vars(sidecar.exporter.counters).items() if k != "extra"}
    counters = {  # calls over connections made: how well keep-alive reuse works
        "engine_connections_opened": (sidecar.engines.connections_made, "Connections opened to http:// engines."),
    }
    text = sidecar.metrics.render(gauges, exporter, counters)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Version": "0.0.4"})
