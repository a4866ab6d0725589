"""The pieces several tests put together the same way: the real receiver and store with the real
sidecar exporting to it in front of an engine (tests/e2e), and an `agl train` config of a small
sync run of the demo tasks plus the flags a test is about (tests/run/test_topology.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agl_trainer.config import Config, load_config
from agl_trainer.store import RolloutStore
from tests.support.waiting import wait_until


@dataclass
class Pipeline:
    sidecar_url: str
    store_path: Path
    _stores: list[RolloutStore] = field(default_factory=list)

    def finish(self, rollout_id: str, reward: float, **end: Any) -> RolloutStore:
        """Report the rollout's reward and end through the sidecar; the store once it is ready."""
        httpx.post(f"{self.sidecar_url}/rollouts/{rollout_id}/reward", json={"value": reward}).raise_for_status()
        httpx.post(f"{self.sidecar_url}/rollouts/{rollout_id}/end", json={"status": "succeeded", **end}).raise_for_status()
        store = RolloutStore(self.store_path, grace_s=0.0)
        self._stores.append(store)
        wait_until(lambda: len(store.ready_rollouts()) == 1, "the rollout to be ready")
        return store


@contextlib.contextmanager
def pipeline(tmp_path: Path, upstream: str, **sidecar: Any) -> Iterator[Pipeline]:
    """A receiver writing tmp_path/store.sqlite, and a sidecar in front of `upstream` sending it spans
    (`sidecar`: more of the sidecar's config)."""
    from agl_sidecar.config import build
    from agl_sidecar.server import BackgroundSidecar
    from agl_trainer.receiver import Receiver, ReceiverConfig

    store_path = tmp_path / "store.sqlite"
    receiver = Receiver(store_path, ReceiverConfig(port=0)).start()
    try:
        settings = {"upstream": [upstream], "listen": "127.0.0.1:0", "otlp_endpoint": receiver.url,
                    "spool_dir": str(tmp_path / "spool"), "export_interval_s": 0.05, **sidecar}  # fmt: skip
        with BackgroundSidecar(build(settings)) as running:
            piped = Pipeline(running.url, store_path)
            try:
                yield piped
            finally:
                for store in piped._stores:
                    store.close()
    finally:
        receiver.stop()


def run_config(
    tmp_path: Path, model_dir: Path, harness: str, *flags: str, tasks: int = 2, mode: str = "sync",
    batch_rollouts: int = 4, max_steps: int = 1,
) -> Config:  # fmt: skip
    """A run of `harness` (module:function) on demo tasks, groups of 2, then `flags` (--key=value)."""
    from examples.demo.task import make_tasks

    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(task) + "\n" for task in make_tasks(tasks, seed=3)))
    return load_config(
        None,
        [
            f"--tasks={tasks_file}", f"--output_dir={tmp_path / 'run'}", f"--model.path={model_dir}",
            f"--harness.function={harness}", "--harness.workers=1", f"--loop.mode={mode}",
            f"--loop.batch_rollouts={batch_rollouts}", "--loop.group_size=2", f"--loop.max_steps={max_steps}",
            "--loop.completion_grace_s=0.2", *flags,
        ],
    )  # fmt: skip
