"""OTLP trace payloads (protobuf or JSON) -> `RawSpan`s, decoded once.

The protobuf path walks the wire format directly instead of building opentelemetry-proto
messages: a span's token arrays are thousands of `AnyValue{int_value}` messages, and turning each
into a Python object is what makes a naive receiver slow. Int and double arrays are decoded with
numpy over the raw bytes (`arrays.py`); everything else is a few fields per span.

Bad data is confined to where it is: a value that cannot be decoded (an int over 64 bits, bad
base64, invalid UTF-8, nesting deeper than MAX_VALUE_DEPTH) becomes a `BadValue` in its attribute,
and a span whose own bytes are broken becomes a RawSpan with `problem` set; the contract turns
either into a violation of that span alone (contract.py). Only a request whose framing is broken
(it cannot be split into spans) raises DecodeError, which the receiver answers with 400.

The decoders: otlp_protobuf.py and otlp_json.py (one each), raw_span.py (what both produce); this
module is their front door.
"""

from agl_trainer.receiver.otlp_json import decode_json
from agl_trainer.receiver.otlp_protobuf import decode_protobuf
from agl_trainer.receiver.raw_span import MAX_VALUE_DEPTH, UINT64_MAX, BadValue, DecodeError, RawSpan

__all__ = ["MAX_VALUE_DEPTH", "UINT64_MAX", "BadValue", "DecodeError", "RawSpan", "decode_json", "decode_protobuf"]
