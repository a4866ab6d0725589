"""The store's single writer: a thread that commits batches, grouping concurrent ones.

Requests hand their records to `submit()` and wait on the future, which resolves only after the
transaction holding them has committed. Whatever queued while a commit ran is written in the next
transaction together, so under load many requests share one fsync.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from agl_trainer.receiver.contract import Record
from agl_trainer.store.records import WriteResult
from agl_trainer.store.rollout_store import RolloutStore

_STOP = object()


class StoreWriter:
    def __init__(self, store: RolloutStore, max_group: int = 64) -> None:
        self._store = store
        self._queue: queue.Queue = queue.Queue()
        self._max_group = max_group
        self._thread = threading.Thread(target=self._run, name="agl-store-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, records: list[Record]) -> Future[WriteResult]:
        future: Future[WriteResult] = Future()
        self._queue.put((records, future))
        return future

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            group = [item]
            stopping = False
            while len(group) < self._max_group:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stopping = True
                    break
                group.append(more)
            self._commit(group)
            if stopping:
                return

    def _commit(self, group: list) -> None:
        try:
            results = self._store.write_batches([batch for batch, _ in group])
        except Exception as error:  # noqa: BLE001 (disk full, locked...: every waiter hears it)
            for _, future in group:
                future.set_exception(error)
            return
        for (_, future), result in zip(group, results, strict=True):
            future.set_result(result)
