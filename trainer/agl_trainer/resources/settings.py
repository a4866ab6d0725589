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
        from agl_trainer.engines.vllm.config import resolve_weight_sync, vllm_config

        settings = {"model": config.model.path, "replicas": config.engine.replicas}
        settings.update(vllm_settings(config, str(config.model.path)))
        try:
            engine = vllm_config(settings)
            resolve_weight_sync(engine, "cpu" if config.backend.device == "cpu" else "cuda")
        except ValueError as error:
            raise vllm_error(error) from None


def engine_takes_adapters(config: Config) -> bool:
    """Will a LoRA run hand the engine the adapter alone (else the merged weights)? What the run's
    engine answers as accepts_adapters: the embedded engine always; vLLM when its settings, as the run
    builds them, serve LoRA (engine.vllm.lora_rank > 0)."""
    if config.backend.lora.rank <= 0:
        return False
    if config.engine.name != "vllm":
        return True
    from agl_trainer.engines.vllm.config import vllm_config
    from agl_trainer.run.settings import vllm_settings

    assert config.model.path is not None
    settings = {"model": config.model.path, "replicas": config.engine.replicas}
    settings.update(vllm_settings(config, str(config.model.path)))
    try:
        return int(getattr(vllm_config(settings), "lora_rank", 0)) > 0
    except ValueError:
        return False  # check_settings reports it
