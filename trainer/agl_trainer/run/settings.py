"""The settings of a run's backend and engine, built from the config in one place.

`agl train` builds its backend and engine from these; `agl train --dry-run` validates the same
settings without starting anything. Every error is a ConfigError naming the key and the fix.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agl_trainer.config import Config, ConfigError


def backend_settings(config: Config, model_path: str, *, cuda_available: bool | None = None) -> Any:
    """A validated TorchBackendConfig, or a VerlBackendConfig around it for backend.name verl.
    `backend.options` and `backend.algorithm` mean the same for both backends; `backend.verl` says
    where verl's workers run. `cuda_available` overrides detection (a dry run checks the GPU
    machine's settings on a machine without one)."""
    from agl_trainer.algorithms import AlgorithmConfig, AlgorithmConfigError
    from agl_trainer.backends import BackendConfigError, TorchBackendConfig

    try:
        training = TorchBackendConfig(
            model_path=model_path,
            lr=config.backend.lr,
            device=config.backend.device,
            seed=config.seed,
            algorithm=AlgorithmConfig(**msgspec.structs.asdict(config.backend.algorithm)),  # the section, checked
            lora=config.backend.lora,
            **msgspec.structs.asdict(config.backend.options),  # the same keys: TorchBackendConfig is a TrainingOptions
        )
        if config.backend.name != "verl":
            return training
        from agl_trainer.backends.verl import VerlBackendConfig

        return VerlBackendConfig(
            training=training,
            rollouts_per_batch=config.loop.batch_rollouts,
            cuda_available=cuda_available,
            **msgspec.structs.asdict(config.backend.verl),  # the section itself: VerlBackendConfig is a VerlSettings
        )
    except AlgorithmConfigError as error:
        raise ConfigError(f"config key backend.{error}") from None
    except BackendConfigError as error:
        raise ConfigError(f"config key {error}") from None


def vllm_settings(config: Config, model_path: str) -> dict[str, Any]:
    """The vLLM engine's settings: engine.options, plus the weight transfer backend.verl.weight_sync
    names when verl trains and the LoRA rank backend.lora.rank names (the engine then serves the base
    once and takes adapter-only syncs); one key for one choice: setting both differently is refused."""
    settings: dict[str, Any] = {"served_model_name": config.model.name, **config.engine.options}
    if config.backend.lora.rank > 0:
        _one_choice(settings, "lora_rank", config.backend.lora.rank, "backend.lora.rank", "")
    if config.backend.name == "verl":
        chosen = config.backend.verl.weight_sync
        _one_choice(settings, "weight_sync", chosen, "backend.verl.weight_sync", " when verl trains")
    return settings


def _one_choice(settings: dict[str, Any], key: str, chosen: Any, owner: str, when: str) -> None:
    """engine.options.`key` takes `owner`'s value; the same key set otherwise there is refused."""
    given = settings.get(key)
    if given is not None and given != chosen:
        raise ConfigError(
            f"config key engine.options.{key}: {given!r} but {owner} is {chosen!r} (fix: set only {owner}{when})"
        )
    settings[key] = chosen


def vllm_error(error: ValueError) -> ConfigError:
    """A vLLM engine setting refused by VLLMConfig, as the config key it came from."""
    key = "backend.verl.weight_sync" if "weight_sync" in str(error) else "engine.options"
    return ConfigError(f"config key {key}: {error}")
