"""A port free now, for a server that must be told its port before it starts (vLLM, a sidecar
started on a port of our choosing, torch.distributed's rendezvous): one that can bind port 0 and
report it should do that instead."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on `host` (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
