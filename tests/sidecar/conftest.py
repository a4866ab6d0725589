"""Fixtures: a fake vLLM upstream and a sidecar factory (real sidecar on a background thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar
from agl_testing.fake_vllm import FakeVLLM


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    with FakeVLLM() as server:
        yield server


@pytest.fixture
def make_sidecar(tmp_path: Any) -> Iterator[Callable[..., BackgroundSidecar]]:
    """make_sidecar(upstream=[...], otlp_endpoint=..., **settings) -> a started BackgroundSidecar."""
    with ExitStack() as stack:

        def start(**settings: Any) -> BackgroundSidecar:
            values = {
                "listen": "127.0.0.1:0",
                "spool_dir": str(tmp_path / "spool"),
                "export_interval_s": 0.05,
                "health_interval_s": 0.2,
            }
            values.update(settings)
            return stack.enter_context(BackgroundSidecar(build(values)))

        yield start
