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


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line("markers", "missing_on_ci(reason): needs what CI lacks; fails under CI=true (support/required.py)")


def pytest_runtest_setup(item) -> None:  # type: ignore[no-untyped-def]
    mark = item.get_closest_marker("missing_on_ci")
    if mark is not None:
        pytest.fail(f"{mark.args[0]} (CI=true: a test that needs it fails instead of skipping)", pytrace=False)
