"""An asyncio event loop on a daemon thread of its own, for a server that lives beside synchronous code
(the receiver, the viewer, the embedded engine; the tests' fake vLLM): the one place that starts it,
hands a failed start to the caller and stops it with nothing left pending. The sidecar, which shares
no code with the trainer, has its own (agl_sidecar/server.py, BackgroundSidecar)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

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
