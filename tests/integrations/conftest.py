"""Fixtures of the integration tests: an OTLP receiver the SDK exports to, sidecars in front of an
engine, and the scripted tool-calling engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import agl
import pytest
from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar

from tests.protocols.adapter_host import AdapterHost
from agl_testing.wire import tool_then_text
from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink


@pytest.fixture
def sink(otlp_sink: OTLPSink, monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPSink]:
    for name in (
        semconv.ENV_ROLLOUT_ID,
        semconv.ENV_TASK_ID,
        semconv.ENV_ATTEMPT,
        semconv.ENV_MODE,
        "OPENAI_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    agl.init(endpoint=otlp_sink.endpoint, service_name="integrations-test")
    yield otlp_sink
    agl.init(endpoint=otlp_sink.endpoint)


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeVLLM]:
    with FakeVLLM() as fake:
        yield fake


@pytest.fixture
def sidecar_for(sink: OTLPSink, tmp_path: Path) -> Iterator[Callable[[str], BackgroundSidecar]]:
    """Starts a sidecar in front of an upstream URL; stopped at the end of the test."""
    started: list[BackgroundSidecar] = []

    def start(upstream: str) -> BackgroundSidecar:
        config = SidecarConfig(
            upstream=[upstream], listen="127.0.0.1:0", otlp_endpoint=sink.endpoint, spool_dir=str(tmp_path / "spool"),
            export_interval_s=0.05,
        )  # fmt: skip
        started.append(BackgroundSidecar(config).__enter__())
        return started[-1]

    yield start
    for sidecar in started:
        sidecar.__exit__(None, None, None)


def weather_upstream() -> AdapterHost:
    """A scripted engine: a get_weather tool call, then (once it sees the tool result) an answer."""
    return AdapterHost(tool_then_text("It is 18C in Paris."))
