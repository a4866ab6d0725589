"""What the proxy works with, named one by one: the sidecar's settings, the gate, the engines, the
span recorder, the metrics, the foreground mark span building waits on, and the client to the
engines (made when the sidecar starts, so reached through a function)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agl_sidecar.config import SidecarConfig
from agl_sidecar.metrics import Metrics
from agl_sidecar.proxy.engine_client import EngineClient
from agl_sidecar.proxy.gate import Gate
from agl_sidecar.proxy.routing import Router
from agl_sidecar.spans.foreground import Foreground
from agl_sidecar.spans.recorder import SpanRecorder


@dataclass(frozen=True, slots=True)
class ProxyParts:
    config: SidecarConfig
    gate: Gate
    router: Router
    recorder: SpanRecorder
    metrics: Metrics
    foreground: Foreground
    engines: Callable[[], EngineClient]
