"""Whether a host is this machine's loopback: the one rule behind the trainer's checks that turn auth
on off loopback (run/topology.py, the viewer's access.py) and refuse URLs that pods cannot reach
(runners/kubernetes_config.py)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """'localhost' (any case), or an IP literal in 127/8 or ::1 (brackets off). Any other name is not:
    it may resolve to anything."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
