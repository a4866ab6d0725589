"""The backend's and engine's own settings checked for `--dry-run`, as on the machine the run is for.

`agl train --dry-run` runs anywhere (a laptop without GPUs validates an 8-GPU config), so the
backend's settings are validated as if CUDA were there when the config asks for GPUs
(backend.device other than cpu); nothing is started (no Ray, no workers, no engine).
"""

from __future__ import annotations

from agl_trainer.config import Config, ConfigError


def check_settings(config: Config) -> None:
    """Raise ConfigError, naming the key and the fix, for a backend or engine setting that cannot work."""
    from agl_trainer.algorithms import AlgorithmConfig, AlgorithmConfigError
    from agl_trainer.backends import BackendConfigError, TorchBackendConfig

    assert config.model.path is not None
    try:
        training = TorchBackendConfig(
            model_path=config.model.path,
            lr=config.backend.lr,
            device=config.backend.device,
            seed=config.seed,
            algorithm=AlgorithmConfig(**config.backend.algorithm),
            **config.backend.options,
        )
        if config.backend.name == "verl":
            from agl_trainer.backends.verl import VerlBackendConfig

            verl = config.backend.verl
            VerlBackendConfig(
                training=training,
                nnodes=verl.nnodes,
                n_gpus_per_node=verl.n_gpus_per_node,
                ray_address=verl.ray_address,
                strategy=verl.strategy,
                param_offload=verl.param_offload,
                optimizer_offload=verl.optimizer_offload,
                gradient_checkpointing=verl.gradient_checkpointing,
                ulysses_sequence_parallel_size=verl.ulysses_sequence_parallel_size,
                weight_sync=verl.weight_sync,
                override=dict(verl.override),
                rollouts_per_batch=config.loop.batch_rollouts,
                cuda_available=config.backend.device != "cpu",
            )
    except TypeError as error:
        raise ConfigError(f"config key backend.options: {error} (fix: see the backend's settings)") from None
    except AlgorithmConfigError as error:
        raise ConfigError(f"config key backend.{error}") from None
    except BackendConfigError as error:
        raise ConfigError(f"config key {error}") from None
    if config.engine.name == "vllm":
        from agl_trainer.engines.vllm import resolve_weight_sync, vllm_config

        settings = {"model": config.model.path, "replicas": config.engine.replicas, **config.engine.options}
        if config.backend.name == "verl":
            settings["weight_sync"] = config.backend.verl.weight_sync
        try:
            engine = vllm_config(settings)
            resolve_weight_sync(engine, "cpu" if config.backend.device == "cpu" else "cuda")
        except ValueError as error:
            key = "backend.verl.weight_sync" if "weight_sync" in str(error) else "engine.options"
            raise ConfigError(f"config key {key}: {error}") from None
