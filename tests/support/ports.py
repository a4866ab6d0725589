"""A free TCP port, for programs that cannot bind port 0 and report the port they got.

Bind-and-release is a race (another process may take the port before the program binds it), so
use this only for such programs (an external collector's config); our own servers bind port 0 and
say their port (`Receiver(..., ReceiverConfig(port=0)).url`, `agl receive` prints its URL).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
