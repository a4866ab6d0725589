"""An asyncio event loop on a daemon thread of its own, for a server that lives beside synchronous code
(the receiver, the viewer, the embedded engine; the tests' fake vLLM): the one place that starts it,
hands a failed start to the caller and stops it with nothing left pending. The sidecar, which shares
no code with the trainer, has its own (agl_sidecar/server.py, BackgroundSidecar)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Self

Step = Callable[[], Awaitable[object]]


class BackgroundLoop:
    def __init__(self, name: str) -> None:
        self.name = name  # the thread's
        self.loop: asyncio.AbstractEventLoop | None = None  # from setup() on, until stop()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, setup: Step, cleanup: Step | None = None, timeout_s: float | None = None) -> None:
        """Run `setup()` on a new loop on a new thread and return once it has, raising what it raised
        (the thread has ended then). The loop then runs until stop(): `cleanup()` runs on it last, and
        the tasks still pending (handlers of clients that never read their answer) are cancelled."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop  # already during setup(): work handed to it from other threads lands
            try:
                loop.run_until_complete(setup())
            except BaseException as error:  # noqa: BLE001 - raised in start()'s caller
                failure.append(error)
                self.loop = None
                loop.close()
                started.set()
                return
            started.set()
            try:
                loop.run_forever()
                if cleanup is not None:
                    loop.run_until_complete(cleanup())
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not started.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start within {timeout_s:g} s")
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop (its cleanup then runs) and wait up to `timeout_s` for the thread to end."""
        loop, thread = self.loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout_s)
        self.loop, self._thread = None, None


class AppServer:
    """An aiohttp application served on `host` at a free port from a BackgroundLoop of its own:
    `start()` (returns once it listens), `port`, `url`, `stop()`. The application is built on the
    loop (`build()`), so its startup and cleanup signals run there."""

    def __init__(self, name: str, build: Callable[[], object], host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._build = build
        self._serving = BackgroundLoop(name)
        self._runner: object | None = None

    @property
    def url(self) -> str:
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Self:
        self._serving.start(self._listen, self._cleanup, timeout_s=timeout_s)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._serving.stop(timeout_s=timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _listen(self) -> None:
        from aiohttp import web

        runner = web.AppRunner(self._build(), access_log=None, handler_cancellation=True)  # type: ignore[arg-type]
        self._runner = runner
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # type: ignore[attr-defined]
