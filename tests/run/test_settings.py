"""The backend's and engine's settings as `agl train` and `--dry-run` both build them (run/settings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, validate
from agl_trainer.run.settings import backend_settings, vllm_settings


def _config(tmp_path: Path, **sections):
    return validate({"model": {"path": str(tmp_path), "name": "served"}, **sections})


def test_verl_weight_sync_reaches_the_vllm_engine(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        backend={"name": "verl", "verl": {"weight_sync": "nccl"}},
        engine={"name": "vllm", "options": {"dtype": "bfloat16"}},
    )
    settings = vllm_settings(config, str(tmp_path))
    assert settings == {"served_model_name": "served", "dtype": "bfloat16", "weight_sync": "nccl"}


def test_torch_backend_keeps_the_engines_own_weight_sync(tmp_path: Path) -> None:
    config = _config(tmp_path, engine={"name": "vllm", "options": {"weight_sync": "cuda_ipc"}})
    assert vllm_settings(config, str(tmp_path))["weight_sync"] == "cuda_ipc"


def test_two_different_weight_syncs_are_refused(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        backend={"name": "verl", "verl": {"weight_sync": "in_place"}},
        engine={"name": "vllm", "options": {"weight_sync": "nccl"}},
    )
    with pytest.raises(ConfigError, match="engine.options.weight_sync: 'nccl' but backend.verl.weight_sync is 'in_place'"):
        vllm_settings(config, str(tmp_path))


def test_backend_errors_name_the_key_once(tmp_path: Path) -> None:
    config = _config(tmp_path, backend={"options": {"micro_batch_tokens": 0}})
    with pytest.raises(ConfigError, match=r"^config key backend\.micro_batch_tokens: 0 must be positive"):
        backend_settings(config, str(tmp_path))
    config = _config(tmp_path, backend={"options": {"no_such_option": 1}})
    with pytest.raises(ConfigError, match="config key backend.options: .*no_such_option"):
        backend_settings(config, str(tmp_path))
