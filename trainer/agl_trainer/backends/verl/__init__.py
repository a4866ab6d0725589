"""The verl backend: agl's update on verl 0.9.1's FSDP2 workers, in a Ray worker group.

    from agl_trainer.backends import TorchBackendConfig
    from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig

    backend = VerlBackend(VerlBackendConfig(
        training=TorchBackendConfig(model_path="path/to/hf-model", device="cpu", lr=1e-6),
        nnodes=1, n_gpus_per_node=2))          # 2 workers (CPU processes here, GPUs with device cuda)
    metrics = backend.train_step(batch, 0)       # same metrics as TorchBackend (+ perf/dispatch_s)
    logprobs = backend.compute_logprobs(batch)   # [N, L]
    weights = backend.state_dict_for_engine()    # {HF name: full CPU tensor}, gathered from the shards
    backend.save_checkpoint(dir); backend.load_checkpoint(dir); backend.save_hf(dir)
    backend.close()                              # workers, and Ray if the backend started it

Which verl worker, and why: verl's `TrainingWorker` (engine_workers.py), subclassed as
`AglTrainingWorker`. It is the engine-level worker verl's own trainers build on (the actor inside
`ActorRolloutRefWorker` *is* a TrainingWorker): one FSDP2 engine per rank with `train_batch`
(zero grad, forward/backward over verl's token-budget micro-batches, clip, step), `infer_batch`,
`get_per_tensor_param` and a sharded checkpoint manager. `ActorRolloutRefWorker(role="actor")` adds
the legacy omega config tree (rollout, checkpoint-engine and ref sections), verl's ppo_loss, and a
weight sync aimed at rollout servers verl launched itself, none of which agl uses: agl's engine or
vLLM is served outside verl. The loss is agl's `rl_objective` with per-token weights computed over
the whole mini-batch on the driver, so rollout-mean aggregation is exact under verl's data-parallel
split and micro-batching; see worker.py for the data-parallel scaling.

Only this package imports verl internals. On a CPU the workers use
agl's platform plugin (platform.py) with gloo; `backend.verl.*` settings are validated in config.py
before Ray or any worker starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl_trainer.backends.verl.backend import VerlBackend
    from agl_trainer.backends.verl.config import VerlBackendConfig

__all__ = ["VerlBackend", "VerlBackendConfig"]


def __getattr__(name: str) -> Any:
    if name == "VerlBackend":
        from agl_trainer.backends.verl.backend import VerlBackend

        return VerlBackend
    if name == "VerlBackendConfig":
        from agl_trainer.backends.verl.config import VerlBackendConfig

        return VerlBackendConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
