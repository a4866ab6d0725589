"""`agl train` with LoRA on real vLLM (CPU build): the demo task with backend.lora.rank 8, so every step
syncs the adapter alone into the vLLM server that serves the base (engines/vllm/lora.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.vllm.conftest import REPO

pytestmark = pytest.mark.vllm

TRAIN_STEPS = 3  # bounded by steps, not seconds: what the tests see must not depend on the load
TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def lora_run(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.task import write_tasks

    work = tmp_path_factory.mktemp("lora-vllm")
    prepared = prepare_demo_model(work, seed=0, progress=False)
    config = yaml.safe_load((REPO / "examples" / "demo" / "config.yaml").read_text())
    config.update(tasks=str(write_tasks(work / "tasks.jsonl", 256, 0)), output_dir=str(work / "train"))
    config["model"]["path"] = str(prepared.path)
    config["engine"] = {"name": "vllm", "options": {"python": vllm_python, "log_dir": str(work / "vllm-logs")}}
    config["backend"]["lora"] = {"rank": 8, "alpha": 16.0}
    config["loop"].update(max_steps=TRAIN_STEPS, max_train_s=TIMEOUT_S, checkpoint_every=1000, val_every=0)
    config.update(val_tasks=None, viewer={"enabled": False})
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [str(Path(sys.executable).parent / "agl"), "train", str(work / "config.yaml"), "--quiet"],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 600,
    )  # fmt: skip
    (work / "agl-train.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, f"agl train failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return work / "train"


def steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def test_every_step_syncs_the_adapter_alone_into_one_vllm_server(lora_run: Path) -> None:
    metrics = steps(lora_run)
    assert len(metrics) == TRAIN_STEPS
    assert [m["policy_version"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert all(m["sync/adapter_only"] == 1.0 for m in metrics)
    full = sum(p.stat().st_size for p in (lora_run.parent / "model-warm").glob("*.safetensors"))
    assert full > 0 and all(0 < m["sync/bytes"] < full / 2 for m in metrics)  # megabytes, not the model
    launches = (lora_run.parent / "vllm-logs" / "vllm-0.log").read_text().count("=== agl: ")
    assert launches == 1  # the base loaded once; every sync in place
    assert sum(m["rollouts/failed"] for m in metrics) == 0
    assert "Traceback" not in (lora_run.parent / "agl-train.log").read_text()
    print(f"\nLoRA on vLLM: {len(metrics)} steps, sync {metrics[-1]['sync/bytes']:.0f} bytes "
          f"(model {full} bytes), {metrics[-1]['time/syncing_s']:.3f} s")  # fmt: skip


def test_the_canary_agrees_after_every_adapter_sync(lora_run: Path) -> None:
    """The canary scores its probes on the engine and the trainer after each sync: equal under LoRA.
    Measured with the canary on the base: max |delta| 0.37 after step 1, growing to 0.99 by step 6."""
    metrics = steps(lora_run)
    assert any("agreement/canary/ok" in m for m in metrics)  # the canary ran
    assert all(m["agreement/canary/ok"] == 1.0 for m in metrics if "agreement/canary/ok" in m), [
        (m["policy_version"], m.get("agreement/canary/max_abs_delta")) for m in metrics
    ]
