"""The backend's and engine's own settings checked for `--dry-run`, as on the machine the run is for.

`agl train --dry-run` runs anywhere (a laptop without GPUs validates an 8-GPU config), so the
backend's settings are validated as if CUDA were there when the config asks for GPUs
(backend.device other than cpu); nothing is started (no Ray, no workers, no engine).
"""

from __future__ import annotations

from agl_trainer.config import Config, ConfigError


def check_settings(config: Config) -> None:
    """Raise ConfigError, naming the key and the fix, for a backend or engine setting that cannot work."""
    from agl_trainer.run.settings import backend_settings, vllm_engine_config, vllm_error

    assert config.model.path is not None
    backend_settings(config, str(config.model.path), cuda_available=config.backend.device != "cpu")
    if config.engine.name == "vllm":
        from agl_trainer.engines.vllm.config import resolve_weight_sync

        engine = vllm_engine_config(config, str(config.model.path))
        try:
            resolve_weight_sync(engine, "cpu" if config.backend.device == "cpu" else "cuda")
        except ValueError as error:
            raise vllm_error(error) from None


def engine_takes_adapters(config: Config) -> bool:
    """Will a LoRA run hand the engine the adapter alone (else the merged weights)? What the run's
    engine answers as accepts_adapters: the embedded engine always; vLLM when its settings, as the run
    builds them, serve LoRA (engine.options.lora_rank > 0, set from backend.lora.rank)."""
    if config.backend.lora.rank <= 0:
        return False
    if config.engine.name != "vllm":
        return True
    from agl_trainer.run.settings import vllm_options

    try:
        return vllm_options(config).lora_rank > 0
    except ConfigError:
        return False  # check_settings reports it
