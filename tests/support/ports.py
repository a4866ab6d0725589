"""A free TCP port, for programs that cannot bind port 0 and report the port they got.

Bind-and-release is a race (another process may take the port before the program binds it), so
use this only for such programs (an external collector's config); our own servers bind port 0 and
say their port (`Receiver(..., ReceiverConfig(port=0)).url`, `agl receive` prints its URL).
"""

from __future__ import annotations

from agl_trainer.addresses import free_port  # the one definition (product code uses it for vLLM's ports)

__all__ = ["free_port"]
