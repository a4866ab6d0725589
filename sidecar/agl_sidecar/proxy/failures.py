"""How a call that did not complete is recorded: why it ended, the error, the upstream-error count,
and the call handed to the span recorder. One place, so every path that ends a call records it alike."""

from __future__ import annotations

from agl import semconv
from agl_sidecar.calls.record import CallRecord
from agl_sidecar.proxy.parts import ProxyParts


def end_call(
    parts: ProxyParts,
    call: CallRecord,
    end_reason: str,
    error_type: str,
    message: str | None = None,
    *,
    upstream_error: bool = False,
) -> None:
    """Record the call as ended by `end_reason` and hand it to the recorder; `upstream_error` counts
    it in the upstream-errors metric."""
    if upstream_error:
        parts.metrics.upstream_errors += 1
    call.fail(end_reason, error_type, message)
    parts.recorder.finish(call)


def client_gone(parts: ProxyParts, call: CallRecord) -> None:
    """The harness went away: record the call as ended by it (once; a finished call is not changed,
    its span is built from it later)."""
    if not call.finished:
        end_call(parts, call, semconv.END_CLIENT_DISCONNECTED, "client_disconnected")
