"""This machine's network addresses, one rule each.

- `is_loopback`: whether a host is this machine's loopback, behind the trainer's checks that turn auth
  on off loopback (run/topology.py, the viewer's access.py) and refuse URLs that pods cannot reach
  (runners/kubernetes_config.py).
- `free_port`: a port free now, for a server that must be told its port before it starts (vLLM, a
  sidecar started on a port of our choosing, torch.distributed's rendezvous); one that can bind port 0
  and report it should do that instead.
"""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """'localhost' (any case), or an IP literal in 127/8 or ::1 (brackets off). Any other name is not:
    it may resolve to anything."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on `host` (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
