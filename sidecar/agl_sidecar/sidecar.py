"""Shared state of one sidecar process: config, gate, router, metrics, exporter, span recorder, proxy,
the client to the engines (proxy/engine_client.py) and an aiohttp session for their probes and
pass-through routes; startup and shutdown."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import aiohttp
from aiohttp import web

from agl import semconv
from agl_sidecar import __version__
from agl_sidecar.config import SidecarConfig
from agl_sidecar.metrics import Metrics
from agl_sidecar.calls.attribution import Identity, bearer_token
from agl_sidecar.proxy.engine_client import EngineClient
from agl_sidecar.proxy.gate import Gate
from agl_sidecar.proxy.handler import Proxy
from agl_sidecar.proxy.request import identity_from
from agl_sidecar.proxy.parts import ProxyParts
from agl_sidecar.proxy.routing import Router
from agl_sidecar.spans.exporter import SpanExporter
from agl_sidecar.spans.foreground import Foreground
from agl_sidecar.spans.otlp import RequestFramer
from agl_sidecar.spans.recorder import SpanRecorder


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
        self.proxy = Proxy(
            ProxyParts(config, self.gate, self.router, self.recorder, self.metrics, self.foreground, lambda: self.engines)
        )
        self._session: aiohttp.ClientSession | None = None  # health probes, /v1/models, /tokenize
        self._engines: EngineClient | None = None  # the calls themselves (proxy/engine_client.py)
        self._health_task: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "sidecar not started"
        return self._session

    @property
    def engines(self) -> EngineClient:
        assert self._engines is not None, "sidecar not started"
        return self._engines

    async def start(self) -> None:
        self._engines = EngineClient(self.config.upstream_timeout_s)
        timeout = aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        # Accept-Encoding: identity: the answers are read (token IDs) and passed on as they came, so an
        # engine (or a proxy before it) must not compress them; aiohttp would ask for gzip, deflate.
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
            headers={"Accept-Encoding": "identity"},
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
        if self._engines is not None:
            await self._engines.close()

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

    def harness_authorized(self, request: web.Request) -> bool:
        """With --api-key or per-rollout keys set, a harness sends one of them (either is enough)."""
        if not self.config.api_key and not self.config.rollout_api_keys:
            return True
        key = bearer_token(request.headers)
        if key is None:
            return False
        if self.config.api_key and same_secret(key, self.config.api_key):
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


SIDECAR_KEY: web.AppKey[Sidecar] = web.AppKey("sidecar")
