"""The trainer's OTLP receiver: decode (wire.py, arrays.py), check the span contract (contract.py),
commit to the store (writer.py), serve HTTP and gRPC (server.py).

Exports resolve lazily, so the store can import the record types without loading the server.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DecodeError": "agl_trainer.receiver.wire",
    "DecodedBatch": "agl_trainer.receiver.payload",
    "decode_body": "agl_trainer.receiver.payload",
    "Receiver": "agl_trainer.receiver.server",
    "ReceiverConfig": "agl_trainer.receiver.server",
    "ReceiverStats": "agl_trainer.receiver.stats",
}

__all__ = ["DecodeError", "DecodedBatch", "Receiver", "ReceiverConfig", "ReceiverStats", "decode_body"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agl_trainer.receiver' has no attribute {name!r}")
