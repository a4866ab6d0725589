"""test_demo_verl.py's pipeline with backend.lora: verl's FSDP workers (world size 2) train the adapter,
every sync hands the embedded engine the adapter alone, the engine then serves exactly the merged
weights the workers hold, and `--resume` continues from the checkpoint's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from tests.verl.test_demo_verl import demo_config, demo_model, run  # noqa: F401 - demo_model: a fixture

pytestmark = pytest.mark.slow


def lora_config(tmp_path: Path, model: Path, max_steps: int):
    config = demo_config(tmp_path, model, max_steps)
    config.backend.lora = msgspec.structs.replace(config.backend.lora, rank=8)  # a frozen section
    config.backend.lr = 2e-3  # the adapter moves each step, so an engine serving the base would show a gap
    return config


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, demo_model: Path):  # noqa: F811 - the imported fixture
    """Two steps and a checkpoint after each: (the run's tmp_path, the result, the per-step checks)."""
    tmp_path = tmp_path_factory.mktemp("verl-lora-demo")
    result, checks = run(lora_config(tmp_path, demo_model, max_steps=2))
    return tmp_path, result, checks


def test_the_engine_serves_the_adapter_the_workers_trained(first_run, demo_model: Path) -> None:  # noqa: F811
    import ray

    tmp_path, result, checks = first_run
    assert result.summary.steps == 2 and result.summary.failures == {}
    assert [(step, version) for step, version, _ in checks] == [(1, 1), (2, 2)]
    assert all(gap == 0.0 for _, _, gap in checks), checks  # the engine's merge is the trainer's
    model_bytes = sum(p.stat().st_size for p in demo_model.glob("*.safetensors"))
    rows = metric_rows(tmp_path / "run")
    assert all(row["sync/adapter_only"] == 1.0 and 0 < row["sync/bytes"] < model_bytes / 4 for row in rows)
    assert any(row["actor/grad_norm"] > 0 for row in rows)
    assert not ray.is_initialized()
    assert list((tmp_path / "run" / "checkpoints").rglob("adapter/adapter_model.safetensors"))


def test_resume_continues_from_the_checkpoints_adapter(first_run, demo_model: Path) -> None:  # noqa: F811
    tmp_path, _, _ = first_run
    result, checks = run(lora_config(tmp_path, demo_model, max_steps=4), resume=True)
    assert result.summary.steps == 4 and result.summary.policy_version == 4
    assert [(step, version) for step, version, _ in checks] == [(3, 3), (4, 4)]
    rows = metric_rows(tmp_path / "run")
    assert [(row["step"], row["policy_version"]) for row in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert all(gap == 0.0 for _, _, gap in checks), checks
