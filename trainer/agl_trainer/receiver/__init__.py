"""The trainer's OTLP receiver: decode (wire.py, arrays.py), check the span contract (contract.py),
commit to the store (writer.py), serve HTTP and gRPC (server.py), import span files (importer.py).

The receiver builds the store's record types (agl_trainer.store.records); the store never imports it.
"""

from agl_trainer.receiver.payload import DecodedBatch, decode_body
from agl_trainer.receiver.server import Receiver, ReceiverConfig
from agl_trainer.receiver.stats import ReceiverStats
from agl_trainer.receiver.wire import DecodeError

__all__ = ["DecodeError", "DecodedBatch", "Receiver", "ReceiverConfig", "ReceiverStats", "decode_body"]
