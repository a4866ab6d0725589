"""loop.switch=keep end to end: runner workers -> agl-sidecar (subprocess) -> embedded engine, 50
rollouts in flight; at each update the engine freezes the calls in flight instead of draining them.
No harness sees an error, and every stored call says which policy version sampled each token."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from agl_trainer.assembly.versions import token_versions
from tests.loop.keep_harnesses import HOLD_S
from tests.loop.test_loop import make_config, model_dir, run_session, store_of  # noqa: F401 (fixture)


def test_50_concurrent_rollouts_through_keep_switches(tmp_path: Path, model_dir: Path, monkeypatch) -> None:  # noqa: F811
    # Long-tailed lengths (most short, a few long), streamed and unary: at every update some calls
    # are mid-generation. What each freeze reported is recorded: the checks below compare the stored
    # boundaries with the engine's own counts, not with how long anything took.
    import threading

    from agl_trainer.engines.embedded.batching import BatchScheduler
    from agl_trainer.engines.embedded.engine import EmbeddedEngine

    # The first update must freeze a call mid-generation, however loaded the machine. Where every call
    # so far has finished when it freezes (generation outran training), one rollout is still to come:
    # the first to reach its second call holds it (keep_harnesses.long_tail, `hold`) until the update
    # says go, and the engine then stops with that call mid-generation until the update's freeze.
    hold = tmp_path / "hold"
    hold.mkdir()
    holding, caught = threading.Event(), threading.Event()
    reports: list[dict[str, int]] = []
    freeze, step = EmbeddedEngine.freeze, BatchScheduler._step

    def recorded(self):  # type: ignore[no-untyped-def]
        report = freeze(self)
        if not reports:  # the first update
            if not report:
                holding.set()
                self.thaw()
                (hold / "go").touch()
                caught.wait(timeout=HOLD_S)  # a hang guard (with 120 s this failed once, under heavy load)
                report = freeze(self)
            (hold / "go").touch()  # the held rollout goes on either way
        reports.append(dict(report))
        return report

    def held_mid_generation(self, admitted):  # type: ignore[no-untyped-def]
        step(self, admitted)
        if holding.is_set() and not caught.is_set():
            if any(not s.finished and 0 < len(s.token_ids) < s.params.max_tokens for s in self._live):
                caught.set()
                while not self._frozen:  # freeze() sets it, then waits for this step to end
                    time.sleep(0.001)

    monkeypatch.setattr(EmbeddedEngine, "freeze", recorded)
    monkeypatch.setattr(BatchScheduler, "_step", held_mid_generation)
    lengths = [4, 6, 8, 10, 12, 16, 24, 40, 64, 96]
    tasks = [
        {"id": f"t{i}", "key": f"k{i % 8}", "tokens": lengths[i % 10], "stream": i % 2 == 1, "hold": str(hold)}
        for i in range(20)
    ]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.keep_harnesses:long_tail",
        mode="collocated-async", batch_rollouts=10, group_size=5, staleness=4, concurrency=50, max_steps=3,
        switch="keep", harness_timeout_s=HOLD_S,  # the held rollout waits for the first update, however long it takes
    )  # fmt: skip
    steps: list[dict[str, float]] = []
    result = run_session(config, lambda step, m: steps.append(m))
    assert result.summary.steps == 3 and result.summary.failures == {}  # no harness saw an error
    # every update froze the calls in flight (none was drained), and said how many it froze
    assert len(reports) == 3 and [m["switch/frozen_requests"] for m in steps] == [float(len(r)) for r in reports]
    frozen = sum(len(r) for r in reports)
    assert reports[0]  # the first update froze calls mid-generation (recorded holds one where none was)
    counts = Counter(n for report in reports for n in report.values())
    boundaries: Counter[int] = Counter()
    crossed_trained = 0  # calls across a switch in a rollout the run trained (the rest ended untrained)
    crossed = 0
    with store_of(config) as store:
        assert set(store.stats().by_cause) <= {"ok"}
        assert store.stats().violations == {}  # every span met the contract (a call frozen before its
        # first token is spanned under the version that sampled it, not refused)
        for info in store.find(""):
            for call in store.load(info.key).calls:
                if call.completion_ids is None or call.completion_ids.size == 0:
                    continue  # cut off when the run ended (its harness cancelled) before a token
                versions = token_versions(call)
                assert versions.size == call.completion_ids.size > 0
                assert versions[0] >= call.policy_version  # starts at the version it entered under (or later)
                assert np.all(np.diff(versions) >= 0) and versions[-1] <= result.summary.policy_version
                if call.policy_versions is not None:
                    crossed += 1
                    crossed_trained += info.trained_step is not None
                    starts = call.policy_versions[0::2]
                    assert starts[0] == 0 and np.all(np.diff(starts) > 0) and starts[-1] < versions.size
                    boundaries.update(int(b) for b in starts[1:])  # where a later version took over
                    if len(starts) == 1:  # frozen before its first token: all of it the new version
                        boundaries[0] += 1
    assert 1 <= crossed <= frozen  # calls generated across a switch carry their boundary
    # each boundary is exactly a token count the engine reported at a freeze
    assert not boundaries - counts, (boundaries, counts)
    # their tokens after the switch are measured apart (agreement/keep_kv), the rest agree at lag 0
    # (whether any such rollout was trained within the 3 steps depends on timing: checked either way)
    assert (sum(m.get("agreement/keep_kv/tokens", 0) for m in steps) >= 1) == (crossed_trained >= 1)
    assert all(m["agreement/lag0/mean_abs_delta"] < 1e-4 for m in steps if "agreement/lag0/tokens" in m)


def test_keep_needs_the_collocated_async_loop(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    import pytest
    from agl_trainer.config import ConfigError

    with pytest.raises(ConfigError, match="loop.switch: keep .* loop.mode=collocated-async"):
        make_config(tmp_path, model_dir, [{"id": "t"}], "tests.loop.keep_harnesses:long_tail", mode="sync", switch="keep")
    with pytest.raises(ConfigError, match="loop.switch"):
        make_config(tmp_path, model_dir, [{"id": "t"}], "tests.loop.keep_harnesses:long_tail", switch="freeze")
