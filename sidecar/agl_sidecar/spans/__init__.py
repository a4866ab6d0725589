"""The span pipeline, off the hot path: a finished call becomes an OTLP span and reaches the receiver.

recorder (calls to spans), token_arrays and otlp (the protobuf encoding), foreground (span building
yields to calls in flight), lru (byte-bounded caches), exporter (batching, retries), spool and
durable (spans on disk when the receiver is away or durability is asked for)."""
