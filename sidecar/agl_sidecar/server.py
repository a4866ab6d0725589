"""Running the sidecar: in the foreground (the CLI) or on a background thread (tests, embedding)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from agl_sidecar.app import build_app
from agl_sidecar.sidecar import SIDECAR_KEY, Sidecar
from agl_sidecar.config import SidecarConfig


class _ClientErrorsAsWarnings(logging.Filter):
    """aiohttp logs a request its HTTP parser refuses (a control character in a header, a malformed
    request line; it answers 400 itself) as an error with a traceback: the client's fault, so one
    warning line says it instead. The trainer's servers have the same filter
    (agl_trainer/receiver/client_errors.py): sidecar and trainer share no code but `agl`."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            record.msg = f"{record.getMessage()}: refused, {exc.code}: {exc.message}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_CLIENT_ERRORS_AS_WARNINGS = _ClientErrorsAsWarnings()


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; stay usable where it cannot install
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def start_site(config: SidecarConfig) -> tuple[web.AppRunner, Sidecar, str]:
    """Start serving; returns the runner, the sidecar state and the base URL actually bound."""
    server_log = logging.getLogger("aiohttp.server")
    if _CLIENT_ERRORS_AS_WARNINGS not in server_log.filters:
        server_log.addFilter(_CLIENT_ERRORS_AS_WARNINGS)
    app = build_app(config)
    # handler_cancellation: a client that goes away cancels its handler, which cancels the
    # upstream request (the engine stops generating for nobody).
    # keepalive_timeout: aiohttp closes a connection still waiting for a whole request head this long
    # after it opened or last answered (its default, an hour, let half-sent requests hold descriptors).
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, keepalive_timeout=config.header_timeout_s
    )
    await runner.setup()
    host, port = config.host_port
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    sockets = site._server.sockets  # type: ignore[union-attr]
    bound = sockets[0].getsockname()
    shown = f"[{bound[0]}]" if sockets[0].family == socket.AF_INET6 else bound[0]
    return runner, app[SIDECAR_KEY], f"http://{shown}:{bound[1]}"


def serve_forever(config: SidecarConfig, on_ready: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully: in-flight calls are cut, queued
    spans are exported or spooled."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)

    async def main() -> None:
        runner, _, url = await start_site(config)
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        on_ready(url)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


class BackgroundSidecar:
    """`with BackgroundSidecar(config) as s:` serves on a thread with its own uvloop loop;
    `s.url` is the base URL, `s.sidecar` the live state, `s.call(fn)` runs fn on the loop."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.url = ""
        self.sidecar: Sidecar | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def __enter__(self) -> BackgroundSidecar:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()
            self.loop = loop
            try:
                self._runner, self.sidecar, self.url = loop.run_until_complete(start_site(self.config))
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()
            self._stopped.set()

        self._thread = threading.Thread(target=run, name="agl-sidecar", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("agl-sidecar did not start within 30 s")
        if errors:
            raise errors[0]
        return self

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `fn` (a coroutine function or plain function) on the sidecar's loop and return its result."""
        assert self.loop is not None

        async def wrapper() -> Any:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def __exit__(self, *exc: Any) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(30)
