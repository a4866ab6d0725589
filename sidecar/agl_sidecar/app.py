"""The sidecar application: routes, shared state, startup and shutdown.

Routes (each model route also under /rollouts/{rollout_id}/ and /rollouts/{rollout_id}/attempts/{n}/):
  POST /v1/chat/completions, /v1/completions; GET /v1/models; POST /v1/<adapter path> (translated)
  POST /rollouts/{rollout_id}/reward, /rollouts/{rollout_id}/end
  /agl/v1/pause, /agl/v1/resume, /agl/v1/state (admin); /healthz; /metrics
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import re
from typing import Annotated, Any

import aiohttp
import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar import __version__
from agl_sidecar.proxy import inputs, wire
from agl_sidecar.proxy.attribution import Identity, bearer_token, parse_traceparent
from agl_sidecar.config import SidecarConfig
from agl_sidecar.spans.exporter import SpanExporter
from agl_sidecar.spans.foreground import Foreground
from agl_sidecar.proxy.fronts import JSON, AdapterFront, OpenAIFront
from agl_sidecar.proxy.gate import Gate
from agl_sidecar.metrics import Metrics
from agl_sidecar.spans.otlp import RequestFramer
from agl_sidecar.protocols.base import ProtocolError
from agl_sidecar.protocols.registry import ADAPTERS, load_adapter
from agl_sidecar.proxy.handler import Proxy
from agl_sidecar.proxy.request import CHAT, COMPLETIONS, DEEP_JSON, identity_from, read_body
from agl_sidecar.proxy.routing import NoUpstream, Router, Upstream, validate_upstream
from agl_sidecar.spans.recorder import SpanRecorder

log = logging.getLogger("agl_sidecar")

ROLLOUT_PREFIXES = ("", "/rollouts/{rollout_id}", "/rollouts/{rollout_id}/attempts/{attempt:\\d+}")
SIDECAR_KEY: web.AppKey[Sidecar] = web.AppKey("sidecar")


class Sidecar:
    """Shared state of one sidecar process."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.gate = Gate(config.max_hold_s, config.policy_version)
        self.router = Router(config.upstream)
        self.metrics = Metrics()
        framer = RequestFramer(
            {"service.name": config.service_name, "service.version": __version__}, semconv.INSTRUMENTATION_SCOPE, __version__
        )
        self.exporter = SpanExporter(
            config.otlp_endpoint,
            framer,
            config.spool_dir,
            protocol=config.otlp_protocol,
            headers=config.otlp_headers,
            max_batch_bytes=config.export_batch_bytes,
            max_memory_bytes=config.export_memory_bytes,
            max_spool_bytes=config.spool_max_bytes,
            interval_s=config.export_interval_s,
            compress=config.compress_export,
            durable=config.durable_spans,
        )
        self.foreground = Foreground()
        self.recorder = SpanRecorder(
            self.exporter,
            config.prompt_ref_memory_bytes,
            foreground=self.foreground,
            token_cache_bytes=config.token_cache_bytes,
            durable=config.durable_spans,
        )
        self.proxy = Proxy(self)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "sidecar not started"
        return self._session

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        await self.exporter.start()
        self.recorder.start()
        self._health_task = asyncio.create_task(
            self.router.health_loop(self._session, self.config.health_interval_s), name="agl-upstream-health"
        )

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.recorder.close()
        await self.exporter.close()
        if self._session is not None:
            await self._session.close()

    async def flush_spans(self, timeout_s: float) -> bool:
        """Build the queued spans and deliver them; True once the endpoint acknowledged every one
        (spooled is not delivered), False if that did not happen within `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if not await self.recorder.drain(timeout_s):
            return False
        return await self.exporter.deliver(max(deadline - loop.time(), 0.001))

    # --- request helpers -----------------------------------------------------------------------
    def identity(self, request: web.Request) -> Identity:
        return identity_from(request, self.config.rollout_api_keys)

    def upstream_authorization(self, request: web.Request, upstream: Upstream) -> str | None:
        """The Authorization the engine gets: --upstream-api-key, else the credentials in the
        upstream's URL (as Basic auth), else the harness's own header when the sidecar has no key."""
        if self.config.upstream_api_key:
            return f"Bearer {self.config.upstream_api_key}"
        if upstream.authorization is not None:
            return upstream.authorization
        # A sidecar with its own API key does not pass the harness's key on.
        if self.config.api_key or self.config.rollout_api_keys:
            return None
        given = request.headers.get("Authorization")
        # A header that arrived with bytes outside latin-1 cannot be sent on as it came.
        return given if given is None or _latin1(given) else None

    def harness_authorized(self, request: web.Request) -> bool:
        if not self.config.api_key:
            return True
        key = bearer_token(request.headers)
        if key is None:
            return False
        if same_secret(key, self.config.api_key):
            return True
        return key in self.config.rollout_api_keys

    def state(self) -> dict[str, Any]:
        gate = self.gate
        counters = {k: v for k, v in vars(self.exporter.counters).items() if k != "extra"}
        counters.update(
            requests=sum(self.metrics.requests.values()),
            held_timeouts=self.metrics.held_timeouts,
            client_disconnects=self.metrics.client_disconnects,
            upstream_errors=self.metrics.upstream_errors,
            calls_recorded=self.recorder.calls_recorded,
            spans_building=self.recorder.backlog,
            span_build_failures=self.recorder.build_failures,
            token_slice_cache_hits=self.recorder.slices.hits,
            token_slice_cache_misses=self.recorder.slices.misses,
        )
        return {
            "paused": gate.paused,
            "in_flight": gate.in_flight,
            "held": gate.held,
            "policy_version": gate.policy_version,
            "upstreams": self.router.urls,
            "upstream_health": {u.url: u.healthy for u in self.router.upstreams},
            "counters": counters,
        }


def same_secret(given: str, expected: str) -> bool:
    """A constant-time comparison of a secret a client sent (any bytes: a header's undecodable
    bytes arrive as surrogates) with the configured one; compare_digest takes only ASCII str."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def _latin1(value: str) -> bool:
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


# --- handlers -----------------------------------------------------------------------------------
def _sidecar(request: web.Request) -> Sidecar:
    return request.app[SIDECAR_KEY]


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type=JSON, headers=headers)


def _openai_error(status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.Response(status=status, body=wire.error_body(message, error_type, param, status), content_type=JSON)


def _bad_input(exc: inputs.BadInput | inputs.TooLarge) -> web.Response:
    if isinstance(exc, inputs.TooLarge):
        return _openai_error(413, exc.message)
    return _openai_error(400, exc.message, param=exc.param)


def _unauthorized() -> web.Response:
    return _openai_error(
        401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the sidecar's --api-key",
        "authentication_error",
    )


async def chat(request: web.Request) -> web.StreamResponse:
    sidecar = _sidecar(request)
    if not sidecar.harness_authorized(request):
        return _unauthorized()
    return await sidecar.proxy.handle(request, CHAT, OpenAIFront(semconv.API_CHAT_COMPLETIONS))


async def completions(request: web.Request) -> web.StreamResponse:
    sidecar = _sidecar(request)
    if not sidecar.harness_authorized(request):
        return _unauthorized()
    return await sidecar.proxy.handle(request, COMPLETIONS, OpenAIFront(semconv.API_COMPLETIONS))


async def models(request: web.Request) -> web.StreamResponse:
    sidecar = _sidecar(request)
    if not sidecar.harness_authorized(request):
        return _unauthorized()
    try:
        upstream = sidecar.router.pick(sidecar.identity(request).rollout_id)
    except inputs.BadInput as exc:
        return _bad_input(exc)
    except NoUpstream:
        return _openai_error(502, "no upstream is configured", "upstream_unreachable")
    if upstream.litellm_model is not None:
        return _json(
            200, {"object": "list", "data": [{"id": upstream.litellm_model, "object": "model", "owned_by": "litellm"}]}
        )
    headers = {}
    auth = sidecar.upstream_authorization(request, upstream)
    if auth:
        headers["Authorization"] = auth
    try:
        async with sidecar.session.get(upstream.url + "/v1/models", headers=headers) as response:
            body = await response.read()
            return web.Response(
                status=response.status, body=body, headers={"Content-Type": response.headers.get("Content-Type", JSON)}
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _openai_error(502, f"upstream {upstream.url} is unreachable ({exc})", "upstream_unreachable")


def translated(path: str) -> Any:
    """A handler for the adapter mounted at /v1{path}."""

    async def handler(request: web.Request) -> web.StreamResponse:
        sidecar = _sidecar(request)
        try:
            adapter = await load_adapter(path)
        except (ImportError, AttributeError) as exc:
            return _openai_error(501, f"/v1{path} is not available in this sidecar: {exc}", "not_implemented")
        try:
            raw = await read_body(request, sidecar.config.max_body_bytes)
        except inputs.TooLarge as exc:
            return _json(413, adapter.error_body(413, exc.message, "invalid_request_error"))
        try:
            original = msgspec.json.decode(raw)
            if not isinstance(original, dict):
                raise ProtocolError(400, "the request body must be a JSON object")
        except msgspec.DecodeError as exc:
            body = adapter.error_body(400, f"request body is not valid JSON: {exc}", "invalid_request_error")
            return _json(400, body)
        except RecursionError:
            return _json(400, adapter.error_body(400, DEEP_JSON, "invalid_request_error"))
        except ProtocolError as exc:
            return _json(exc.status, adapter.error_body(exc.status, exc.message, exc.error_type))
        if not sidecar.harness_authorized(request):
            return _json(401, adapter.error_body(401, "missing or wrong API key", "authentication_error"))
        try:
            chat_request = adapter.to_chat_request(original)
            sidecar.identity(request)  # ids a span cannot carry: refused here, in this protocol's shape
        except ProtocolError as exc:
            return _json(exc.status, adapter.error_body(exc.status, exc.message, exc.error_type))
        except inputs.BadInput as exc:
            return _json(400, adapter.error_body(400, exc.message, "invalid_request_error"))
        except RecursionError:
            return _json(400, adapter.error_body(400, DEEP_JSON, "invalid_request_error"))
        chat_bytes = msgspec.json.encode(chat_request)
        if adapter.tokenize_only:
            return await _tokenize(sidecar, request, adapter, original, chat_bytes)
        front = AdapterFront(adapter, original)
        try:
            return await sidecar.proxy.handle(request, CHAT, front, chat_bytes)
        except ProtocolError as exc:
            return _json(exc.status, adapter.error_body(exc.status, exc.message, exc.error_type))

    return handler


async def _tokenize(sidecar: Sidecar, request: web.Request, adapter: Any, original: dict[str, Any], chat_bytes: bytes) -> web.Response:
    try:
        upstream = sidecar.router.pick(sidecar.identity(request).rollout_id)
    except NoUpstream:
        return _json(502, adapter.error_body(502, "no upstream is configured", "api_error"))
    headers = {"Content-Type": "application/json"}
    auth = sidecar.upstream_authorization(request, upstream)
    if auth:
        headers["Authorization"] = auth
    try:
        async with sidecar.session.post(upstream.url + "/tokenize", data=chat_bytes, headers=headers) as response:
            body = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _json(502, adapter.error_body(502, f"upstream {upstream.url} is unreachable ({exc})", "api_error"))
    if status != 200:
        return _json(status, adapter.error_body(status, body.decode(errors="replace"), "api_error"))
    try:
        return _json(200, adapter.from_chat_response(msgspec.json.decode(body), original))
    except ProtocolError as exc:
        return _json(exc.status, adapter.error_body(exc.status, exc.message, exc.error_type))
    except (msgspec.MsgspecError, RecursionError) as exc:
        return _json(502, adapter.error_body(502, f"upstream /tokenize answered an unreadable body: {exc}", "api_error"))


# --- rewards and rollout ends -------------------------------------------------------------------
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


class BodyError(ValueError):
    """A body that does not decode as `kind`; `param` names the top-level field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = re.split(r"[.\[]", param, maxsplit=1)[0] if param else None


def _decode_body(raw: bytes, kind: type, what: str) -> Any:
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise BodyError(f"{what}: {exc}", wire.error_param(exc)) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"{what}: the body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BodyError(f"{what}: {DEEP_JSON}") from None


async def reward(request: web.Request) -> web.Response:
    sidecar = _sidecar(request)
    if not sidecar.harness_authorized(request):
        return _unauthorized()
    try:
        raw = await read_body(request, sidecar.config.max_body_bytes)
        body: RewardBody = _decode_body(raw, RewardBody, "reward")
    except inputs.TooLarge as exc:
        return _bad_input(exc)
    except BodyError as exc:
        message = f"{exc}; expected {{\"value\": 1.0, \"name\": \"reward\"}}"
        return _openai_error(400, message, param=exc.param)
    if isinstance(body.value, bool) or not math.isfinite(float(body.value)):
        return _openai_error(400, f"reward value must be a finite number, got {body.value!r}", param="value")
    if not body.name:
        return _openai_error(400, "reward name must be a non-empty string", param="name")
    try:
        inputs.text(body.name, "name")
        inputs.text(body.task_id, "task_id")
        identity = sidecar.identity(request)
    except inputs.BadInput as exc:
        return _bad_input(exc)
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
    return _json(200, {"rollout_id": identity.rollout_id, "name": body.name, "value": float(body.value)})


async def end_rollout(request: web.Request) -> web.Response:
    sidecar = _sidecar(request)
    if not sidecar.harness_authorized(request):
        return _unauthorized()
    try:
        raw = await read_body(request, sidecar.config.max_body_bytes)
        body: EndBody = _decode_body(raw, EndBody, "end")
    except inputs.TooLarge as exc:
        return _bad_input(exc)
    except BodyError as exc:
        message = f"{exc}; expected {{\"status\": \"succeeded\"}}"
        return _openai_error(400, message, param=exc.param)
    if body.status not in (semconv.STATUS_SUCCEEDED, semconv.STATUS_FAILED):
        return _openai_error(
            400, f"status must be 'succeeded' or 'failed', got {body.status!r}", param="status"
        )
    if body.mode is not None and body.mode not in semconv.MODES:
        return _openai_error(400, f"mode must be one of {list(semconv.MODES)}, got {body.mode!r}", param="mode")
    try:
        inputs.text(body.task_id, "task_id")
        identity = sidecar.identity(request)
    except inputs.BadInput as exc:
        return _bad_input(exc)
    identity.task_id = body.task_id or identity.task_id
    identity.mode = body.mode or identity.mode
    sidecar.recorder.rollout_end(identity, body.status, parse_traceparent(request.headers.get("traceparent")))
    await sidecar.exporter.sync_durable()  # --durable-spans: the end's span is on disk before the 200
    return _json(200, {"rollout_id": identity.rollout_id, "status": body.status})


# --- admin --------------------------------------------------------------------------------------
MAX_PAUSE_TIMEOUT_S = 7 * 24 * 3600.0  # an event loop timer takes no more


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    drain: bool = False
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_PAUSE_TIMEOUT_S)] = 60.0


class ResumeBody(msgspec.Struct, forbid_unknown_fields=True):
    policy_version: inputs.Count | None = None
    upstreams: list[str] | None = None


def admin_only(handler: Any) -> Any:
    """Admin endpoints need the bearer token, or with none configured a loopback client (a check
    on these routes only: model calls pay nothing for it)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        sidecar = _sidecar(request)
        token = sidecar.config.admin_token
        if token:
            given = request.headers.get("Authorization", "")
            if not (given[:7].lower() == "bearer " and same_secret(given[7:].strip(), token)):
                return _json(401, {"error": "admin API: send 'Authorization: Bearer <admin token>' (--admin-token)"})
        elif not _is_loopback(request.remote):
            return _json(
                403, {"error": "admin API: no --admin-token is configured, so only loopback clients may use it"}
            )
        return await handler(request)

    return guarded


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


async def pause(request: web.Request) -> web.Response:
    sidecar = _sidecar(request)
    try:
        body: PauseBody = _decode_body(await read_body(request, sidecar.config.max_body_bytes), PauseBody, "pause")
    except inputs.TooLarge as exc:
        return _json(413, {"error": exc.message})
    except ValueError as exc:
        return _json(400, {"error": f"{exc}; expected {{\"drain\": true, \"timeout_s\": 60}}"})
    if body.timeout_s <= 0:
        return _json(400, {"error": "pause: timeout_s must be > 0"})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.timeout_s
    sidecar.gate.pause()
    if not body.drain:
        return _json(200, _short_state(sidecar))
    if not await sidecar.gate.drain(body.timeout_s):
        state = _short_state(sidecar)
        state["error"] = f"in-flight calls did not finish within {body.timeout_s:g} s; the sidecar stays paused"
        return _json(504, state)
    # A drained pause also delivers the drained calls' spans (built off the calls' path, so maybe not
    # sent yet): the trainer assembles its batch right after it, and a rollout whose call spans are
    # missing then would be dropped as having no samples.
    # spans_flushed: acknowledged by the endpoint, not merely spooled (the trainer reads them from there).
    spans_flushed = await sidecar.flush_spans(max(deadline - loop.time(), 1.0))
    counters = sidecar.exporter.counters
    return _json(200, {
        **_short_state(sidecar),
        "spans_flushed": spans_flushed,
        "spans_building": sidecar.recorder.backlog,
        "spans_pending": counters.spans_pending,
        "spans_in_spool": counters.spans_in_spool,
        "spans_dead_lettered": counters.spans_dead_lettered,
        "spans_failed": counters.spans_failed,
    })


async def resume(request: web.Request) -> web.Response:
    sidecar = _sidecar(request)
    try:
        body: ResumeBody = _decode_body(await read_body(request, sidecar.config.max_body_bytes), ResumeBody, "resume")
    except inputs.TooLarge as exc:
        return _json(413, {"error": exc.message})
    except ValueError as exc:
        return _json(400, {"error": f"{exc}; expected {{\"policy_version\": 3, \"upstreams\": [\"http://...\"]}}"})
    if body.upstreams is not None:
        if not body.upstreams:
            return _json(400, {"error": "resume: upstreams must not be empty"})
        for url in body.upstreams:
            problem = validate_upstream(url)
            if problem:
                return _json(400, {"error": f"resume: {problem}"})
        sidecar.router.set_urls(body.upstreams)
    sidecar.gate.resume(body.policy_version)
    return _json(200, _short_state(sidecar))


async def state(request: web.Request) -> web.Response:
    return _json(200, _sidecar(request).state())


def _short_state(sidecar: Sidecar) -> dict[str, Any]:
    gate = sidecar.gate
    return {"paused": gate.paused, "in_flight": gate.in_flight, "held": gate.held, "policy_version": gate.policy_version}


async def healthz(request: web.Request) -> web.Response:
    return _json(200, {"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    sidecar = _sidecar(request)
    gate = sidecar.gate
    gauges = {
        "in_flight": gate.in_flight,
        "held": gate.held,
        "paused": int(gate.paused),
        "policy_version": gate.policy_version,
        "healthy_upstreams": sum(1 for u in sidecar.router.upstreams if u.healthy),
    }
    exporter = {k: v for k, v in vars(sidecar.exporter.counters).items() if k != "extra"}
    text = sidecar.metrics.render(gauges, exporter)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Version": "0.0.4"})


# --- assembly -----------------------------------------------------------------------------------
def build_app(config: SidecarConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    sidecar = Sidecar(config)
    app[SIDECAR_KEY] = sidecar
    for prefix in ROLLOUT_PREFIXES:
        app.router.add_post(prefix + "/v1/chat/completions", chat)
        app.router.add_post(prefix + "/v1/completions", completions)
        app.router.add_get(prefix + "/v1/models", models)
        for path in ADAPTERS:
            app.router.add_post(prefix + "/v1" + path, translated(path))
        if prefix:
            app.router.add_post(prefix + "/reward", reward)
            app.router.add_post(prefix + "/end", end_rollout)
    app.router.add_post("/agl/v1/pause", admin_only(pause))
    app.router.add_post("/agl/v1/resume", admin_only(resume))
    app.router.add_get("/agl/v1/state", admin_only(state))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)

    async def lifecycle(app: web.Application) -> Any:
        await sidecar.start()
        yield
        await sidecar.close()

    app.cleanup_ctx.append(lifecycle)
    return app
