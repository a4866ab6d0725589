"""One rule for "this machine's loopback" (agl_trainer.addresses), and the pods' check built on it."""

from __future__ import annotations

import pytest

from agl_trainer.addresses import is_loopback
from agl_trainer.runners.kubernetes_config import unreachable_from_pods


@pytest.mark.parametrize("host", ["localhost", "LocalHost", "127.0.0.1", "127.8.9.10", "::1"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "10.0.0.5", "127.0.0.1.evil.example", "localhost.", "[::1]"])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(
    ("url", "unreachable"),
    [
        ("http://127.0.0.1:8400", True),
        ("http://LOCALHOST:8400", True),
        ("http://[::1]:8400", True),
        ("http://0.0.0.0:8400", True),  # a wildcard listen address: a pod dialing it reaches itself
        ("http://[::]:8400", True),
        ("http://10.0.0.5:8400", False),
        ("http://agl-trainer.train.svc:8400", False),
    ],
)
def test_urls_pods_cannot_reach(url: str, unreachable: bool) -> None:
    assert unreachable_from_pods(url) is unreachable
