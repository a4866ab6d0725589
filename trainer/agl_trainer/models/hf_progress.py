"""`quiet_progress()`: transformers' progress bars off for the calls inside it, back on after.

transformers draws a bar at every model load ("Loading weights") and every save ("Writing model
shards"); a run loads the model in its backend, reference model and engine, and saves a checkpoint
every `loop.checkpoint_every` steps: bar lines in a run's log that say nothing (and `\r` soup in a
file). A run (`Session.run`) and the demo's warm start hold it for their whole length and report
progress themselves; outside them bars stay as the user set them. Nested and concurrent uses (the
checkpoint and the weight sync can run in different threads) restore the state once, when the last
one ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    from transformers.utils import logging

    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = logging.is_progress_bar_enabled()
            logging.disable_progress_bar()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                logging.enable_progress_bar()
