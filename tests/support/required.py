"""A test that needs something this machine may lack (a browser, a collector): skipped here when it
is missing, but under CI=true it fails instead, naming what is missing, so a green CI cannot hold
none of these tests (tests/conftest.py fails a test marked `missing_on_ci`)."""

from __future__ import annotations

import os

import pytest


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def requires(available: bool, reason: str) -> pytest.MarkDecorator:
    """`@requires(path.exists(), "no rotel-agent here (pip install rotel)")` on a test, or in `pytestmark`."""
    if available:
        return pytest.mark.skipif(False, reason=reason)  # a no-op mark (a bare usefixtures() warns)
    return pytest.mark.missing_on_ci(reason) if on_ci() else pytest.mark.skip(reason=reason)
