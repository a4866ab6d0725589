"""Benchmark: what `agl train --from-store` spends choosing each step's rollouts, incremental vs full scan.

    python bench/from_store.py [--quick]

Builds a store of N ready rollouts (one call, a reward and an end span each; 8 tasks of N/8) through
the store's own write path, copies it, and runs the same steps on each copy: read (the close of quiet
rollouts, the ready rollouts, the call versions), select, hand out 64 rollouts, mark them trained (a
checkpoint every step: the reference's best case, its ready set shrinks at once), and 16 new
rollouts arrive before the next step. The reference is what a step read before (store/cursor.py's FullScan:
every rollout, every ready one, every call); the cursor (StoreCursor) reads what changed. Prints the
mean time a step spends reading and selecting (the first step apart: both read everything then),
the rollout rows each read, and the ratio. Default N = 20,000, 40 steps; --quick: N = 3,000, 20 steps.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH, ARRIVALS = 64, 16


def run(path: Path, incremental: bool, steps: int, first_new: int) -> tuple[float, list[float], float]:
    """Seconds of the first step, of each later step, and mean rows read by a later step."""
    from agl_trainer.loop.stored import select
    from agl_trainer.store.cursor import FullScan, StoreCursor
    from agl_trainer.store import RolloutStore
    from agl_testing.rollouts import write_rollouts

    store = RolloutStore(path, durability="normal", grace_s=0.0)
    reader = (StoreCursor if incremental else FullScan)(store, path)
    times, rows = [], []
    try:
        for step in range(1, steps + 1):
            started = time.perf_counter()
            infos = reader.refresh(600.0, time.time())
            selection = select(infos, reader.min_versions, group_size=8, min_group_size=2, staleness=-1,
                               max_age_s=0, now=time.time(), current=reader.newest,
                               max_versions=reader.max_versions)  # fmt: skip
            batch = [key for group in selection.groups for key in group][:BATCH]
            reader.forget(batch)
            times.append(time.perf_counter() - started)
            rows.append(reader.rows_read)
            assert len(batch) == BATCH, (step, len(batch))
            store.mark_trained(batch, step)
            new = range(first_new + (step - 1) * ARRIVALS, first_new + step * ARRIVALS)
            write_rollouts(store, [f"r-{i}" for i in new], tasks=8)
    finally:
        store.close()
    return times[0], times[1:], statistics.mean(rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3,000 rollouts, 20 steps")
    parser.add_argument("--rollouts", type=int, default=None)
    args = parser.parse_args()
    n = args.rollouts or (3_000 if args.quick else 20_000)
    steps = 20 if args.quick else 40

    from agl_trainer.store import RolloutStore
    from agl_testing.rollouts import write_rollouts

    with tempfile.TemporaryDirectory(prefix="agl-bench-from-store-") as folder:
        full_path, cursor_path = Path(folder) / "full.db", Path(folder) / "cursor.db"
        started = time.perf_counter()
        with RolloutStore(full_path, durability="normal") as store:
            write_rollouts(store, [f"r-{i}" for i in range(n)], tasks=8)
        shutil.copy(full_path, cursor_path)
        print(f"store: {n:,} ready rollouts in 8 tasks, built in {time.perf_counter() - started:.1f} s;"
              f" {steps} steps of {BATCH}, {ARRIVALS} new rollouts after each")  # fmt: skip
        full_first, full_steps, full_rows = run(full_path, False, steps, n)
        cur_first, cur_steps, cur_rows = run(cursor_path, True, steps, n)
    full, cursor = statistics.mean(full_steps), statistics.mean(cur_steps)
    print(f"  first step (both read the whole store): full scan {full_first * 1e3:8.1f} ms, cursor {cur_first * 1e3:8.1f} ms")
    print(f"  later steps, mean read + select:        full scan {full * 1e3:8.1f} ms, cursor {cursor * 1e3:8.1f} ms"
          f"   ({full / cursor:.1f}x faster)")  # fmt: skip
    print(f"  rollout rows read a later step:         full scan {full_rows:8.0f},    cursor {cur_rows:8.0f}")


if __name__ == "__main__":
    main()
