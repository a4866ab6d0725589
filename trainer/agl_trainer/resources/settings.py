"""The backend's and engine's own settings checked for `--dry-run`, as on the machine the run is for.

`agl train --dry-run` runs anywhere (a laptop without GPUs validates an 8-GPU config), so the
backend's settings are validated as if CUDA were there when the config asks for GPUs
(backend.device other than cpu); nothing is started (no Ray, no workers, no engine).
"""

from __future__ import annotations

from agl_trainer.config import Config


def check_settings(config: Config) -> None:
    """Raise ConfigError, naming the key and the fix, for a backend or engine setting that cannot work."""
    from agl_trainer.run.settings import backend_settings, vllm_error, vllm_settings

    assert config.model.path is not None
    backend_settings(config, str(config.model.path), cuda_available=config.backend.device != "cpu")
    if config.engine.name == "vllm":
        from agl_trainer.engines.vllm_config import resolve_weight_sync, vllm_config

        settings = {"model": config.model.path, "replicas": config.engine.replicas}
        settings.update(vllm_settings(config, str(config.model.path)))
        try:
            engine = vllm_config(settings)
            resolve_weight_sync(engine, "cpu" if config.backend.device == "cpu" else "cuda")
        except ValueError as error:
            raise vllm_error(error) from None
