"""Shared fixtures. Every test runs offline: no hub, no network beyond loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.otlp_sink import OTLPSink  # noqa: E402


@pytest.fixture
def otlp_sink() -> Iterator[OTLPSink]:
    with OTLPSink() as sink:
        yield sink
