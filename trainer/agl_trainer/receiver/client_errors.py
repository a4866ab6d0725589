"""aiohttp logs a request its HTTP parser refuses (a control character in a header, a bad
Content-Length, a request line over 8190 bytes; it answers the 400 itself) as an ERROR with a
traceback: the client's fault, not the server's, so one warning line says it instead. Installed by
the trainer's HTTP servers (the receiver, the viewer); the sidecar has its own (no shared imports)."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


class ClientErrorsAsWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            record.msg = f"{record.getMessage()}: refused, {exc.code}: {exc.message}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_FILTER = ClientErrorsAsWarnings()


def quiet_client_errors() -> None:
    """Install the filter on aiohttp's server logger (once per process)."""
    server_log = logging.getLogger("aiohttp.server")
    if _FILTER not in server_log.filters:
        server_log.addFilter(_FILTER)
