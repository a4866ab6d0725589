"""What the driver hands each verl worker (worker.WorkerSettings): the backend's typed settings as they
are, plus the few values resolved for the workers' device; it crosses Ray pickled. No worker starts."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec

from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends.settings import LoraConfig, VerlSettings
from agl_trainer.backends.torch_config import TorchBackendConfig
from agl_trainer.backends.verl import VerlBackendConfig
from agl_trainer.backends.verl.backend import VerlBackend


def _settings(config: VerlBackendConfig):  # type: ignore[no-untyped-def]
    backend = VerlBackend.__new__(VerlBackend)  # its settings only: no Ray, no workers
    backend.config, backend.training = config, config.training
    return backend._worker_settings()


def test_workers_get_the_typed_sections_and_what_the_driver_resolved(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"attention_dropout": 0.1, "hidden_dropout": 0.0}')  # read for dropout
    training = TorchBackendConfig(
        model_path=str(tmp_path), device="cpu", lr=3e-3, seed=7, betas=(0.8, 0.95), max_grad_norm=None,
        algorithm=AlgorithmConfig(kl_coef=0.1), lora=LoraConfig(rank=4, target_modules=("q_proj",)),
        compute_dtype="float32", packing="padded", gradient_checkpointing=False,
    )  # fmt: skip
    config = VerlBackendConfig(training=training, n_gpus_per_node=2, gradient_checkpointing=True,
                               override={"engine.use_dynamic_bsz": True}, cuda_available=False)  # fmt: skip
    settings = _settings(config)
    assert settings.training is training  # as the backend holds it: no copy
    assert type(settings.verl) is VerlSettings  # backend.verl alone, without the driver-side checks
    assert settings.verl == msgspec.convert(config, VerlSettings, from_attributes=True)
    assert settings.verl.override == {"engine.use_dynamic_bsz": True} and settings.verl.n_gpus_per_node == 2
    # resolved on the driver for a CPU worker group
    assert (settings.attn_implementation, settings.model_dtype, settings.compute_dtype) == ("sdpa", "fp32", "fp32")
    assert settings.dist_backend == "cpu:gloo" and not settings.use_remove_padding
    assert settings.gradient_checkpointing  # backend.verl's, or backend.options'
    assert settings.lora is training.lora
    assert settings.model_override == {"attention_dropout": 0.0}  # disable_dropout: the model's dropout off

    copied = pickle.loads(pickle.dumps(settings))  # as Ray moves it
    assert copied == settings and copied.training.betas == (0.8, 0.95) and copied.training.algorithm.kl_coef == 0.1

    plain = _settings(msgspec.structs.replace(config, training=msgspec.structs.replace(training, lora=LoraConfig())))
    assert plain.lora is None
