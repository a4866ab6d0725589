"""The settings of a run's backend and engine, built from the config in one place.

`agl train` builds its backend and engine from these; `agl train --dry-run` validates the same
settings without starting anything. Every error is a ConfigError naming the key and the fix.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from agl_trainer.config import Config, ConfigError
from agl_trainer.engines.vllm.config import VLLMConfig, VLLMOptions

T = TypeVar("T")


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
            algorithm=AlgorithmConfig(**algorithm_section(config)),  # the section, checked
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


def algorithm_section(config: Config) -> dict[str, Any]:
    """backend.algorithm with loss_temperature resolved: null trains the distribution the training
    rollouts were sampled from (sampling.train.temperature), or the model's own where they are greedy."""
    section = msgspec.structs.asdict(config.backend.algorithm)
    if section["loss_temperature"] is None:
        sampled = config.sampling.train
        section["loss_temperature"] = 1.0 if sampled.greedy else sampled.temperature
    return section


def vllm_engine_config(config: Config, model_path: str) -> VLLMConfig:
    """The vLLM engine's config: model.path, engine.replicas and engine.options as they are, but for the
    values other sections own (vllm_options); a setting the engine refuses is a ConfigError naming its key."""
    try:
        return VLLMConfig(model=model_path, replicas=config.engine.replicas, options=vllm_options(config))
    except ValueError as error:
        raise vllm_error(error) from None


def vllm_options(config: Config) -> VLLMOptions:
    """engine.options of the vLLM engine, with the name served (model.name unless they name one), the
    weight transfer backend.verl.weight_sync names when verl trains and the LoRA rank backend.lora.rank
    names (the engine then serves the base once and takes adapter-only syncs); one key for one choice:
    engine.options setting one of those to another value than its default and the owner's is refused."""
    options = config.engine.options
    if not isinstance(options, VLLMOptions):
        raise ConfigError(f"config key engine.name: {config.engine.name}, not vllm (fix: engine.name: vllm)")
    name = options.served_model_name or config.model.name
    lora_rank, weight_sync = options.lora_rank, options.weight_sync
    if config.backend.lora.rank > 0:
        lora_rank = _one_choice("lora_rank", lora_rank, 0, config.backend.lora.rank, "backend.lora.rank", "")
    if config.backend.name == "verl":
        chosen = config.backend.verl.weight_sync
        weight_sync = _one_choice("weight_sync", weight_sync, "in_place", chosen, "backend.verl.weight_sync",
                                  " when verl trains")  # fmt: skip
    return msgspec.structs.replace(options, served_model_name=name, lora_rank=lora_rank, weight_sync=weight_sync)


def _one_choice(key: str, given: T, default: T, chosen: T, owner: str, when: str) -> T:
    """engine.options.`key` takes `owner`'s value; another value set there is refused."""
    if given != default and given != chosen:
        raise ConfigError(
            f"config key engine.options.{key}: {given!r} but {owner} is {chosen!r} (fix: set only {owner}{when})"
        )
    return chosen


def vllm_error(error: ValueError) -> ConfigError:
    """A vLLM engine setting refused by VLLMConfig, as the config key it came from (its message names
    the key, engine.options.KEY or engine.replicas, but for the weight path's)."""
    message = str(error)
    if "weight_sync" in message:
        return ConfigError(f"config key backend.verl.weight_sync: {message}")
    return ConfigError(f"config key {message}" if message.startswith("engine.") else f"config key engine.options: {message}")
