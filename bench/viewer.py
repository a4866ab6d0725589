"""Benchmark: the trace viewer (`agl traces serve`) on a 100k-rollout store.

    python bench/viewer.py [--quick]

Builds a store of 100,000 rollouts (2 calls each, a tenth with a merge break, rewards, 1,400
training steps) through the store's own write path, plus one 200-call rollout, then measures:
time to first byte of the rollouts API (default page, sorted, filtered, a deep page) against a raw
SQLite query of the same rows and against `agl traces ls` (its default 50) on the same store;
the rendered rollouts page in headless Chromium (`--dump-dom`) against the same browser loading a
static page; and the 200-call rollout page (API and rendered, tokens decoded) against `agl traces
inspect` of the same rollout. --quick: 3,000 rollouts.

    python bench/viewer.py --big

One rollout of 4,000 and one of 20,000 calls (a thread whose every prompt extends the last call by
reference, 28 new tokens a call): the rollout API's time to first byte (its first page) and
`assemble_rollout` alone, against the same with assembly as it was before it became near-linear
(bench/_assembly_before.py, measured in the same run; at 20,000 calls only an estimate of its
memory is printed: it holds every call's whole context again, quadratic in calls).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import numpy as np
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import CallSpan, RewardSpan, RolloutSpan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIG_ID = "big-200-calls"


def _call(rollout_id: str, seq: int, prompt: np.ndarray, completion: np.ndarray, task: str, mode: str,
          start: int, version: int = 0, ref: tuple[int, int] | None = None) -> CallSpan:  # fmt: skip
    return CallSpan(
        span_id=os.urandom(8), call_seq=seq, name="chat bench", end_ns=start + 30_000_000, prompt_ids=prompt,
        completion_ids=completion, logprobs=np.full(completion.size, -0.4, np.float32),
        prompt_ref_seq=None if ref is None else ref[0], prompt_ref_length=None if ref is None else ref[1],
        prompt_length=None if ref is not None else int(prompt.size), policy_version=version,
        finish_reason="stop", end_reason="completed", tokens_source="engine", trace_id=os.urandom(16),
        rollout_id=rollout_id, attempt=0, task_id=task, mode=mode, start_ns=start, status_code=0,
    )  # fmt: skip


def build_store(path: Path, rollouts: int, vocab: int) -> float:
    """The store, through RolloutStore.write_batches; returns seconds taken."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    store = RolloutStore(path, durability="normal", grace_s=0.0)
    t0 = 1_700_000_000_000_000_000
    batch: list[list] = []
    for index in range(rollouts):
        rid, task = f"rollout-{index:06d}", f"task-{index // 8:05d}"
        mode = "val" if index % 10 == 9 else "train"
        prompt = rng.integers(5, vocab, 32).astype(np.int32)
        first = rng.integers(5, vocab, 16).astype(np.int32)
        tool = rng.integers(5, vocab, 8).astype(np.int32)
        second_prompt = np.concatenate([prompt, first, tool])
        if index % 10 == 3:  # the harness edited its context: a merge break
            second_prompt = second_prompt.copy()
            second_prompt[40] = (second_prompt[40] + 1) % vocab
        start = t0 + index * 1_000_000
        records = [
            _call(rid, 0, prompt, first, task, mode, start, version=index // 64),
            _call(rid, 1, second_prompt, rng.integers(5, vocab, 16).astype(np.int32), task, mode, start + 40_000_000,
                  version=index // 64),
            RewardSpan(span_id=os.urandom(8), name="reward", value=float(rng.random()), call_seq=None, end_ns=start,
                       trace_id=os.urandom(16), rollout_id=rid, attempt=0, task_id=task),
            RolloutSpan(trace_id=os.urandom(16), span_id=os.urandom(8), rollout_id=rid, attempt=0, task_id=task, mode=mode,
                        status="failed" if index % 50 == 7 else "succeeded", start_ns=start, end_ns=start + 90_000_000, error=None),
        ]  # fmt: skip
        batch.append(records)
        if len(batch) == 500:
            store.write_batches(batch)
            batch = []
    big = [_big_calls(rng, vocab, t0)]
    store.write_batches([*batch, *big])
    store.refresh_completion()
    trained = [f"rollout-{i:06d}" for i in range(rollouts) if i % 10 != 9]
    for step, begin in enumerate(range(0, len(trained), 64), start=1):
        store.mark_trained(trained[begin : begin + 64], step)
    store.close()
    return time.perf_counter() - started


def _big_calls(rng: np.random.Generator, vocab: int, t0: int) -> list:
    """A 200-call rollout whose calls merge (each prompt sent by reference to the previous call)."""
    records: list = []
    length = 0
    for seq in range(200):
        suffix = rng.integers(5, vocab, 48 if seq == 0 else 24).astype(np.int32)
        completion = rng.integers(5, vocab, 40).astype(np.int32)
        ref = None if seq == 0 else (seq - 1, length)
        records.append(_call(BIG_ID, seq, suffix, completion, "task-big", "train", t0 + seq * 50_000_000, ref=ref))
        length += suffix.size + completion.size
    records.append(RolloutSpan(trace_id=os.urandom(16), span_id=os.urandom(8), rollout_id=BIG_ID, attempt=0,
                               task_id="task-big", mode="train", status="succeeded", start_ns=t0,
                               end_ns=t0 + 200 * 50_000_000, error=None))  # fmt: skip
    records.append(RewardSpan(span_id=os.urandom(8), name="reward", value=1.0, call_seq=None, end_ns=t0,
                              trace_id=os.urandom(16), rollout_id=BIG_ID, attempt=0, task_id="task-big"))  # fmt: skip
    return records


def ttfb(url: str, repeats: int) -> float:
    """Median seconds from sending GET to the response's status line and headers (the first byte)."""
    parts = urllib.parse.urlsplit(url)
    times = []
    for _ in range(repeats):
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        started = time.perf_counter()
        connection.request("GET", parts.path + ("?" + parts.query if parts.query else ""))
        response = connection.getresponse()
        times.append(time.perf_counter() - started)
        body = response.read()
        assert response.status == 200, body[:300]
        connection.close()
    return statistics.median(times)


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def raw_page(path: Path) -> None:
    """The reference: the same 50 rows (newest first, calls counted, final reward) by hand in SQLite."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.execute(
        "SELECT r.rollout_id, r.task_id, r.mode, r.end_cause, r.trained_step,"
        " (SELECT COUNT(*) FROM calls c WHERE c.rollout_id = r.rollout_id AND c.attempt = r.attempt),"
        " (SELECT value FROM rewards w WHERE w.rollout_id = r.rollout_id AND w.name = 'reward' AND w.call_seq IS NULL"
        "  ORDER BY end_ns DESC LIMIT 1) FROM rollouts r ORDER BY r.rowid DESC LIMIT 50"
    ).fetchall()
    db.execute("SELECT COUNT(*) FROM rollouts").fetchone()
    db.close()


def quiet_cli(argv: list[str]) -> None:
    from agl_trainer.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0


def chromium_time(executable: str, url: str, expect: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as profile:
            started = time.perf_counter()
            out = subprocess.run(
                [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--virtual-time-budget=9000", "--dump-dom", url],
                capture_output=True, text=True, timeout=300,
            ).stdout  # fmt: skip
            times.append(time.perf_counter() - started)
        assert expect in out, f"{url} did not render {expect!r}"
    return statistics.median(times)


def big_rollout_store(path: Path, calls: int) -> int:
    """A store holding one rollout of `calls` calls, prompts by reference; returns its tokens."""
    rng = np.random.default_rng(0)
    records: list = []
    length = 0
    for seq in range(calls):
        suffix = rng.integers(5, 300, 24 if seq else 48).astype(np.int32)
        completion = rng.integers(5, 300, 4).astype(np.int32)
        ref = None if seq == 0 else (seq - 1, length)
        records.append(_call(BIG_ID, seq, suffix, completion, "task-big", "train", 1_700_000_000_000_000_000 + seq, ref=ref))
        length += suffix.size + completion.size
    records.append(RewardSpan(span_id=os.urandom(8), name="reward", value=1.0, call_seq=None, end_ns=0,
                              trace_id=os.urandom(16), rollout_id=BIG_ID, attempt=0, task_id="task-big"))  # fmt: skip
    records.append(RolloutSpan(trace_id=os.urandom(16), span_id=os.urandom(8), rollout_id=BIG_ID, attempt=0,
                               task_id="task-big", mode="train", status="succeeded", start_ns=0, end_ns=1, error=None))  # fmt: skip
    store = RolloutStore(path, durability="normal", grace_s=0.0)
    store.write_batches([records])
    store.refresh_completion()
    store.close()
    return length


def big_rollouts(repeats: int) -> None:
    import _assembly_before
    from agl_trainer.assembly import AssemblyConfig, assemble_rollout
    from agl_trainer.viewer import Viewer, ViewerServer

    print("one big rollout (a thread of calls, prompts by reference), the rollout API's first page:")
    with tempfile.TemporaryDirectory(prefix="agl-bench-viewer-big-") as folder:
        for calls in (4_000, 20_000):
            path = Path(folder) / f"big-{calls}.db"
            tokens = big_rollout_store(path, calls)
            with RolloutStore(path, grace_s=0.0) as store:
                data = store.load(store.ready_rollouts()[0].key)
            assembled = timed(lambda: assemble_rollout(data, AssemblyConfig()), repeats)  # noqa: B023
            viewer = Viewer(path, index=False, budget_s=600)
            with ViewerServer(viewer, "127.0.0.1:0") as server:
                api = ttfb(server.url + "api/rollout?id=" + BIG_ID, repeats)
                line = (f"  {calls:6,} calls, {tokens:9,} tokens: API {api:6.2f} s, assemble_rollout {assembled:6.2f} s")
                if calls <= 4_000:
                    with _assembly_before.patched():
                        before_api = ttfb(server.url + "api/rollout?id=" + BIG_ID, 1)
                        before = timed(lambda: assemble_rollout(data, AssemblyConfig()), 1)  # noqa: B023
                    line += (f"; before: API {before_api:6.2f} s ({before_api / api:5.1f}x),"
                             f" assemble_rollout {before:6.2f} s ({before / assembled:5.1f}x)")  # fmt: skip
                else:
                    held = sum(48 + 28 * i for i in range(calls)) * 2 * 4  # prompt + full sequence, int32, every call
                    line += f"; before: not run (it would hold {held / 2**30:.0f} GiB of copied contexts)"
                print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3,000 rollouts instead of 100,000")
    parser.add_argument("--rollouts", type=int, default=None)
    parser.add_argument("--big", action="store_true", help="only the 4,000- and 20,000-call rollouts")
    args = parser.parse_args()
    if args.big:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        big_rollouts(3)
        return
    rollouts = args.rollouts or (3_000 if args.quick else 100_000)
    repeats = 3 if args.quick else 5

    from agl_trainer.viewer import Viewer, ViewerServer
    from agl_testing.tiny_tokenizer import tiny_tokenizer

    with tempfile.TemporaryDirectory(prefix="agl-bench-viewer-") as folder:
        path = Path(folder) / "rollouts.db"
        seconds = build_store(path, rollouts, vocab=390)
        size = path.stat().st_size / 1e6
        print(f"store: {rollouts + 1:,} rollouts ({size:.0f} MB) built in {seconds:.1f} s through RolloutStore.write_batches")
        tokenizer = Path(folder) / "tokenizer"
        tiny_tokenizer().save_pretrained(tokenizer)

        viewer = Viewer(path, model=str(tokenizer))
        with ViewerServer(viewer, "127.0.0.1:0") as server:
            url = server.url
            rows = [
                ("page 1 (newest 50)", "api/rollouts"),
                ("sorted by reward", "api/rollouts?sort=reward"),
                ("filtered: task + mode", "api/rollouts?task=task-00042&mode=train"),
                ("filtered: reward >= 0.9", "api/rollouts?min_reward=0.9"),
                ("deep page (offset 90%)", f"api/rollouts?offset={int(rollouts * 0.9)}"),
            ]
            busy = ttfb(url + "api/rollouts", repeats)
            started = time.perf_counter()
            while not viewer.indexer.done:  # type: ignore[union-attr]
                time.sleep(0.2)
            indexed = time.perf_counter() - started
            progress = viewer.indexer.progress()  # type: ignore[union-attr]
            print(f"indexer (merge breaks, policy versions, calls, rewards): {progress['indexed']:,} rollouts,"
                  f" done {indexed:.1f} s after the viewer started; page 1 while it worked: {busy * 1e3:.1f} ms")  # fmt: skip
            rows.append(("filtered: merge breaks >= 1", "api/rollouts?min_breaks=1&sort=breaks"))
            raw = timed(lambda: raw_page(path), repeats)
            quiet_cli(["traces", "ls", "--store", str(path)])  # once for its imports: time the work itself
            ls = timed(lambda: quiet_cli(["traces", "ls", "--store", str(path)]), repeats)
            print(f"\nrollouts API, time to first byte (median of {repeats}):")
            print(f"  reference: raw SQLite query of the same 50 rows {raw * 1e3:8.1f} ms;"
                  f" `agl traces ls` (newest 50) {ls * 1e3:8.1f} ms")  # fmt: skip
            for label, query in rows:
                t = ttfb(url + query, repeats)
                print(f"  {label:28s} {t * 1e3:8.1f} ms   {t / raw:6.1f}x raw SQL   {t / ls:6.2f}x agl traces ls")
            html = ttfb(url, repeats)
            print(f"  the page itself (/)          {html * 1e3:8.1f} ms")

            big = ttfb(url + "api/rollout?id=" + BIG_ID, repeats)
            inspect = timed(lambda: quiet_cli(["traces", "inspect", BIG_ID, "--store", str(path), "--model",
                                               str(tokenizer), "--max-tokens", "100000"]), repeats)  # fmt: skip
            print(f"\n200-call rollout ({200 * 64 + 24:,} tokens decoded): API time to first byte {big * 1e3:.1f} ms;"
                  f" `agl traces inspect --model` of it {inspect * 1e3:.1f} ms ({big / inspect:.2f}x)")  # fmt: skip

            executable = shutil.which("chromium") or shutil.which("chromium-browser")
            if executable is None:
                print("\nno Chromium: rendered-page timings skipped (apt-get install chromium)")
                return
            static = Path(folder) / "static.html"
            static.write_text("<!doctype html><title>static</title><table id=t><tr><td>static page</td></tr></table>")
            blank = chromium_time(executable, static.as_uri(), "static page", repeats)
            page = chromium_time(executable, url + "#/", 'id="rollouts"', repeats)
            rollout = chromium_time(executable, url + "#/rollout?id=" + BIG_ID, "Sample 0", repeats)
            print(f"\nheadless Chromium, --dump-dom wall time (median of {repeats}; includes the browser's start):")
            print(f"  reference: a static page          {blank:6.2f} s")
            print(f"  rollouts page ({rollouts:,} rollouts)  {page:6.2f} s   +{page - blank:5.2f} s over the static page")
            print(f"  200-call rollout page              {rollout:6.2f} s   +{rollout - blank:5.2f} s over the static page")


if __name__ == "__main__":
    main()
