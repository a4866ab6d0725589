"""Per token, the trainer's logprob of what it trained, beside the run's store: `agreement.db` in the
run's output directory, one row per trained sample. The trace viewer (viewer/agreement.py) sets
each token's engine logprob against it (|delta| per token, a summary per sample).

Its own small SQLite file, not a table of the rollout store: the receiver owns that one's writes,
and a run without it (verl, `--from-store`) simply shows no per-token agreement.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np

FILE = "agreement.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    sample INTEGER NOT NULL,
    step INTEGER NOT NULL,
    trained_version INTEGER NOT NULL,
    trainer_logprobs BLOB NOT NULL,  -- float32 per token of the sample, NaN where not trained
    at REAL NOT NULL,
    PRIMARY KEY (rollout_id, attempt, sample)
) WITHOUT ROWID;
"""


class AgreementLog:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / FILE
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def write(self, step: int, version: int, results: list[Any], logprobs: Any) -> int:
        """`logprobs` [N, L]: the backend's for TrainingBatch.from_rollouts(results) (rows in order of
        rollouts, then samples). Returns the rows written."""
        values = logprobs.float().numpy()
        rows = []
        row = 0
        now = time.time()
        for result in results:
            for index, sample in enumerate(result.samples):
                n = len(sample.token_ids)
                blob = np.ascontiguousarray(values[row, :n], dtype=np.float32).tobytes()
                rows.append((result.rollout_id, result.attempt, index, step, version, blob, now))
                row += 1
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        return len(rows)

    def close(self) -> None:
        self._db.close()


def read(run_dir: Path, rollout_id: str, attempt: int) -> dict[int, tuple[int, int, np.ndarray]]:
    """sample -> (step, trained version, trainer logprobs) of one rollout; {} without a log."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return {}
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            found = db.execute(
                "SELECT sample, step, trained_version, trainer_logprobs FROM samples WHERE rollout_id = ? AND attempt = ?",
                (rollout_id, attempt),
            ).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return {}
    return {int(s): (int(step), int(v), np.frombuffer(blob, dtype=np.float32)) for s, step, v, blob in found}
