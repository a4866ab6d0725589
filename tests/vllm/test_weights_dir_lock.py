"""Two runs on one engine weights_dir (a shared filesystem, as several nodes need): the second is
refused at start, naming the first, before it touches a file; the first's adapter and versions are
left as they were. Before, the second's start pointed `lora/current` at its empty adapter and deleted
the first's versions. Runs on any machine against the stdlib stand-in of vLLM (test_engine_control.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from agl_trainer.engines.vllm.engine import VLLMEngine, VLLMError
from agl_trainer.weights.update import WeightUpdate

from tests.vllm.test_engine_control import fake_config
from tests.vllm.test_vllm_lora_control import adapter, model_config

OTHER_RUN = """
import sys
from pathlib import Path
from agl_trainer.engines.vllm.weights_lock import WeightsDirInUse, WeightsDirLock
lock = WeightsDirLock(Path(sys.argv[1]))
try:
    lock.acquire()
except WeightsDirInUse as error:
    print(error)
    sys.exit(3)
print("acquired")
"""


def _lora_engine(tmp_path: Path, weights: Path, name: str) -> VLLMEngine:
    events = {"FAKE_VLLM_EVENTS": str(tmp_path / f"{name}.jsonl")}
    return VLLMEngine(fake_config(tmp_path, served_model_name="tiny", lora_rank=4, weights_dir=str(weights),
                                  env=events, log_dir=str(tmp_path / f"logs-{name}")))  # fmt: skip


def test_a_second_run_on_the_same_weights_dir_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    model_config(tmp_path)
    weights = tmp_path / "shared"
    first = _lora_engine(tmp_path, weights, "first")
    first.start()
    try:
        first.update_weights(WeightUpdate(version=3, adapter=adapter()))
        lora = weights / "lora"
        before = (os.readlink(lora / "current"), sorted(p.name for p in lora.iterdir()))
        assert before == ("v3", ["current", "v0-empty", "v3"])
        # Another run, in another process (another node on the shared filesystem).
        other = subprocess.run([sys.executable, "-c", OTHER_RUN, str(weights)], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
        assert other.returncode == 3, other.stderr
        assert f"pid {os.getpid()}" in other.stdout and "in use by another run" in other.stdout
        # Another engine of this process: the same refusal, before its start touches a file.
        second = _lora_engine(tmp_path, weights, "second")
        with pytest.raises(VLLMError, match="in use by another"):
            second.start()
        second.stop()
        assert (os.readlink(lora / "current"), sorted(p.name for p in lora.iterdir())) == before
    finally:
        first.stop()
    # Once the first run stops (or dies: the kernel drops its lock), the directory is free again.
    third = _lora_engine(tmp_path, weights, "third")
    third.start()
    third.stop()


def test_a_killed_run_leaves_no_lock_behind(tmp_path: Path) -> None:
    weights = tmp_path / "shared"
    holder = subprocess.Popen([sys.executable, "-c", OTHER_RUN + "import time; time.sleep(600)\n", str(weights)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "acquired"
        refused = subprocess.run([sys.executable, "-c", OTHER_RUN, str(weights)], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
        assert refused.returncode == 3 and f"pid {holder.pid}" in refused.stdout
    finally:
        holder.kill()
        holder.wait()
    again = subprocess.run([sys.executable, "-c", OTHER_RUN, str(weights)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert again.returncode == 0 and again.stdout.strip() == "acquired"
