"""Where agl's spans go: the harness's own TracerProvider, or a private OTLP/HTTP pipeline.

agl lives inside someone else's process, so it never installs a global TracerProvider. If the
harness configured OpenTelemetry, agl's spans join that pipeline; otherwise agl builds a private
provider exporting OTLP/HTTP. At exit the private pipeline is flushed with a bounded wait, and spans
that could not be delivered are reported on stderr with their count: never lost silently.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from agl import semconv
from agl._version import __version__

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.trace import Tracer

DEFAULT_EXIT_FLUSH_TIMEOUT_S = 5.0
MAX_EXIT_FLUSH_TIMEOUT_S = 3600.0  # an exit that waits longer is a hang, and int(inf * 1000) raises
_lock = threading.Lock()
_tracer: Tracer | None = None
_private_provider: TracerProvider | None = None
_exporter: _CountingExporter | None = None


def init(
    endpoint: str | None = None,
    service_name: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Configure where agl's spans go. Calling it is optional: the first span initialises from the
    environment (`AGL_OTLP_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`).

    If the process already has an OpenTelemetry SDK TracerProvider, agl uses it and ignores
    `endpoint`; otherwise it exports OTLP/HTTP protobuf to `endpoint` (a base URL such as
    `http://localhost:4318`, or the full `.../v1/traces` URL).
    """
    if endpoint is not None and not isinstance(endpoint, str):
        raise TypeError(f"agl.init: endpoint must be a URL string, got {type(endpoint).__name__}")
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"agl.init: endpoint must start with http:// or https://, got {endpoint!r}")
    if service_name is not None and not isinstance(service_name, str):
        raise TypeError("agl.init: service_name must be a string")
    if headers is not None:
        if not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise TypeError("agl.init: headers must be a mapping of str to str")
    global _tracer
    with _lock:
        _shutdown_private_locked()
        _tracer = _build_tracer(endpoint, service_name, headers)


def get_tracer() -> Tracer:
    """The tracer agl's spans are made with, initialising from the environment on first use."""
    global _tracer
    if _tracer is None:
        with _lock:
            if _tracer is None:
                _tracer = _build_tracer(None, None, None)
    return _tracer


def flush(timeout_s: float = DEFAULT_EXIT_FLUSH_TIMEOUT_S) -> bool:
    """Export every finished span now; True when all were delivered within `timeout_s`."""
    from opentelemetry import trace

    provider = _private_provider or trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is None:
        return True
    ok = bool(force_flush(int(timeout_s * 1000)))
    return ok and (_exporter is None or _exporter.failed == 0)


def _harness_provider() -> TracerProvider | None:
    """The harness's SDK TracerProvider, when it installed one."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    # The API's default is a proxy or no-op provider: neither records anything.
    if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return None
    return provider  # type: ignore[return-value]


def _build_tracer(
    endpoint: str | None, service_name: str | None, headers: Mapping[str, str] | None
) -> Tracer:
    harness = _harness_provider()
    if harness is not None:
        return harness.get_tracer(semconv.INSTRUMENTATION_SCOPE, __version__)

    global _private_provider, _exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url = _traces_url(endpoint)
    resource = Resource.create(
        {"service.name": service_name or os.environ.get(semconv.ENV_SERVICE_NAME) or "agl-harness"}
    )
    provider = TracerProvider(resource=resource)
    if url is not None:
        _exporter = _CountingExporter(
            OTLPSpanExporter(endpoint=url, headers=dict(headers or _env_headers()), timeout=5),
            url,
        )
        # Reward and rollout spans are small and few: a generous queue so none is dropped.
        provider.add_span_processor(
            BatchSpanProcessor(_exporter, max_queue_size=65536, schedule_delay_millis=200)
        )
    else:
        print(
            "agl: no OTLP endpoint configured (set AGL_OTLP_ENDPOINT or call agl.init(endpoint=...));"
            " spans are not exported",
            file=sys.stderr,
        )
    _private_provider = provider
    atexit.register(_flush_at_exit)
    return provider.get_tracer(semconv.INSTRUMENTATION_SCOPE, __version__)


def _traces_url(endpoint: str | None) -> str | None:
    source = "agl.init(endpoint=...)"
    as_is = False  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the full URL, used as is (its spec)
    if not endpoint:
        for name in (semconv.ENV_OTLP_ENDPOINT, semconv.ENV_OTEL_TRACES_ENDPOINT, semconv.ENV_OTEL_ENDPOINT):
            endpoint = os.environ.get(name)
            if endpoint:
                source, as_is = f"environment variable {name}", name == semconv.ENV_OTEL_TRACES_ENDPOINT
                break
    if not endpoint:
        return None
    endpoint = endpoint.strip()
    # Checked here, where it enters: a URL the exporter cannot use lost every span, its message
    # only "could not deliver ... is the collector running?".
    problem = None
    if not endpoint.startswith(("http://", "https://")):
        problem = "must start with http:// or https://"
    else:
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as error:
            problem = f"is not a valid URL ({error})"
        else:
            if not parts.hostname:
                problem = "has no host"
    if problem:
        raise ValueError(f"agl: {source}={endpoint[:200]!r} {problem}, e.g. http://127.0.0.1:4318")
    if as_is:
        return endpoint
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def _env_headers() -> dict[str, str]:
    """AGL_OTLP_HEADERS as given (`k=v,k=v`), else OTEL_EXPORTER_OTLP_HEADERS as its spec and the
    OpenTelemetry SDKs read it: values percent-encoded (`authorization=Bearer%20abc`; taken
    literally, the receiver got `Bearer%20abc` and refused every span with a 401)."""
    raw = os.environ.get(semconv.ENV_OTLP_HEADERS)
    decode = False
    if not raw:
        raw, decode = os.environ.get(semconv.ENV_OTEL_HEADERS, ""), True
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    if decode:
        from urllib.parse import unquote

        return {unquote(key.strip()): unquote(value.strip()) for key, value in pairs}
    return {key.strip(): value.strip() for key, value in pairs}


def _flush_at_exit() -> None:
    with _lock:
        _shutdown_private_locked()


def _shutdown_private_locked() -> None:
    global _private_provider, _exporter, _tracer
    provider, exporter = _private_provider, _exporter
    _private_provider, _exporter, _tracer = None, None, None
    if provider is None:
        return
    flushed = provider.force_flush(int(_exit_flush_timeout_s() * 1000))
    if exporter is not None:
        exporter.give_up_after_flush(flushed)
    provider.shutdown()


def _exit_flush_timeout_s() -> float:
    """AGL_EXIT_FLUSH_TIMEOUT_S, or the default with a warning when it is not a number >= 0: this
    runs at exit, where raising would skip the flush and lose every span still buffered."""
    raw = os.environ.get(semconv.ENV_EXIT_FLUSH_TIMEOUT)
    if raw is None or raw.strip() == "":
        return DEFAULT_EXIT_FLUSH_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_EXIT_FLUSH_TIMEOUT_S:
        print(
            f"agl: {semconv.ENV_EXIT_FLUSH_TIMEOUT}={raw[:40]!r} is not a number of seconds from 0 to "
            f"{MAX_EXIT_FLUSH_TIMEOUT_S:g}; flushing with the default {DEFAULT_EXIT_FLUSH_TIMEOUT_S:g} s",
            file=sys.stderr,
        )
        return DEFAULT_EXIT_FLUSH_TIMEOUT_S
    return value


class _CountingExporter:
    """Wraps the OTLP exporter to count what could not be delivered, and say so on stderr."""

    def __init__(self, inner: object, url: str) -> None:
        self._inner = inner
        self._url = url
        self.failed = 0
        self.pending = 0

    def export(self, spans: Sequence[ReadableSpan]) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.pending += len(spans)
        try:
            result = self._inner.export(spans)  # type: ignore[attr-defined]
        except Exception:  # an exporter bug must not lose the count
            result = SpanExportResult.FAILURE
        self.pending -= len(spans)
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
            print(
                f"agl: could not deliver {len(spans)} span(s) to {self._url}"
                f" ({self.failed} undelivered so far); is the collector or trainer running?",
                file=sys.stderr,
            )
        return result

    def give_up_after_flush(self, flushed: bool) -> None:
        if not flushed and self.pending:
            print(
                f"agl: gave up on {self.pending} span(s) still being sent to {self._url} at exit",
                file=sys.stderr,
            )

    def shutdown(self) -> None:
        self._inner.shutdown()  # type: ignore[attr-defined]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
