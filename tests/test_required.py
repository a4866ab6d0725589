"""A test that needs a browser or a collector skips where it is missing, but fails under CI=true:
a green CI cannot hold none of them (support/required.py, the hook in conftest.py)."""

from __future__ import annotations

import pytest

from tests import conftest
from tests.support.required import requires


class Item:
    def __init__(self, mark: pytest.MarkDecorator) -> None:
        self.mark = mark.mark

    def get_closest_marker(self, name: str):  # type: ignore[no-untyped-def]
        return self.mark if self.mark.name == name else None


def test_a_missing_browser_skips_here_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert requires(False, "no Chromium here").mark.name == "skip"
    present = requires(True, "no Chromium here").mark
    assert present.name == "skipif" and present.args == (False,)  # a no-op: the test runs
    monkeypatch.setenv("CI", "true")
    mark = requires(False, "no Chromium here")
    assert mark.mark.name == "missing_on_ci"
    with pytest.raises(pytest.fail.Exception, match="no Chromium here .CI=true"):
        conftest.pytest_runtest_setup(Item(mark))
    conftest.pytest_runtest_setup(Item(requires(True, "no Chromium here")))  # present: runs
