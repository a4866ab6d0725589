"""`Indexer`: a background thread that assembles every rollout once (and again when new spans
arrive) to fill the viewer's summary table: policy versions, merge breaks and their classes.

These need assembly, which is too slow to run per page on 100k rollouts; the rollouts table shows
them as soon as a rollout is indexed (newest first) and filters on them once indexing is done.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.store.records import RolloutKey
from agl_trainer.store.queries import Database, attach, load, rollout_count, touched_since

log = logging.getLogger("agl.viewer")

BATCH = 256
SLACK_S = 5.0  # rows whose last span is this close to the watermark are looked at again


class Indexer:
    def __init__(self, database: Database, config: AssemblyConfig, *, poll_s: float = 2.0, duty: float = 1.0) -> None:
        self.database = database
        self.config = config
        self.poll_s = poll_s
        self.duty = duty  # the share of time it may run: below 1 beside a training loop (the GIL is shared)
        self.indexed = 0
        self.total = 0
        self.done = False  # caught up at least once
        self._seen: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agl-viewer-indexer", daemon=True)

    def start(self) -> Indexer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def progress(self) -> dict[str, Any]:
        return {"indexed": self.indexed, "total": self.total, "done": self.done}

    def _run(self) -> None:
        reader = attach(self.database.store_path)
        try:
            watermark = float("-inf")
            while not self._stop.is_set():
                try:
                    watermark = self._pass(reader, watermark)
                except Exception:  # noqa: BLE001 (a bad rollout or a busy file must not end indexing)
                    log.exception("viewer indexing failed; retrying")
                self.done = True
                self._stop.wait(self.poll_s)
        finally:
            reader.close()

    def _pass(self, reader: Any, watermark: float) -> float:
        self.total = rollout_count(reader)
        rows = touched_since(reader, watermark - SLACK_S)
        todo = [(r, a, t) for r, a, t in rows if self._seen.get((r, a)) != t]
        for start in range(0, len(todo), BATCH):
            if self._stop.is_set():
                break
            began = time.perf_counter()
            out = [self._summarise(reader, *item) for item in todo[start : start + BATCH]]
            out = [row for row in out if row is not None]
            with self.database.lock:
                self.database.db.executemany(
                    "INSERT OR REPLACE INTO summary VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", out
                )
            for row in out:
                self._seen[(row[0], row[1])] = row[-1]
            self.indexed = len(self._seen)
            busy = time.perf_counter() - began
            self._stop.wait(busy * (1 - self.duty) / self.duty if self.duty < 1 else 0)
        return max((t for _, _, t in rows), default=watermark)

    def _summarise(self, reader: Any, rollout_id: str, attempt: int, last_span_at: float) -> tuple | None:
        loaded = load(reader, RolloutKey(rollout_id, attempt))
        if loaded is None:
            return None
        data, _ = loaded
        assembly = assemble_rollout(data, self.config)
        versions = [c.policy_version for c in data.calls if c.policy_version is not None]
        kinds: dict[str, int] = {}
        for failure in assembly.merge_failures:
            kinds[failure.kind] = kinds.get(failure.kind, 0) + 1
        samples = 0 if assembly.result is None else len(assembly.result.samples)
        return (
            rollout_id,
            attempt,
            len(data.calls),
            data.final_reward(self.config.reward_name),
            min(versions) if versions else None,
            max(versions) if versions else None,
            len(assembly.merge_failures),
            json.dumps(kinds, sort_keys=True),
            samples,
            assembly.reward,
            assembly.dropped,
            last_span_at,
        )
