"""Ray for the verl backend: attach to a cluster (`ray_address`) or start a local one, then place
nnodes x n_gpus_per_node workers in verl's `RayWorkerGroup` (one placement group per node).

Every process verl runs in needs the same environment before it imports verl (on the CPU the
platform plugin's variables): it is set in the job's runtime_env and in each worker's env.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

from agl_trainer.backends.torch_config import BackendConfigError
from agl_trainer.backends.verl.config import VerlBackendConfig


def worker_env(device: str) -> dict[str, str]:
    """The environment of every verl process for workers on `device` (cpu or cuda)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "VERL_USE_EXTERNAL_PLUGINS": "none"}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if name in os.environ:
            env[name] = os.environ[name]
    if device == "cpu":
        from agl_trainer.backends.verl.platform_env import platform_env

        env.update(platform_env())
    return env


def prepare_driver(config: VerlBackendConfig) -> None:
    """Make this process's verl see the same platform as the workers (before verl is used here)."""
    if config.device != "cpu":
        return
    from agl_trainer.backends.verl.platform_env import platform_env

    for name, value in platform_env().items():
        os.environ.setdefault(name, value)
    from verl.plugin.platform import platform_manager

    from agl_trainer.backends.verl import platform

    current = platform_manager._current_platform
    if current is not None and current.device_name != "cpu":
        platform_manager.set_platform(platform.PlatformCPU())


@dataclass
class RayHandle:
    started_here: bool

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def connect(config: VerlBackendConfig) -> RayHandle:
    """Attach to ray_address, or start a local Ray sized for the workers; reuse an initialised one."""
    import ray

    env = worker_env(config.device)
    if ray.is_initialized():
        check_resources(config)
        return RayHandle(started_here=False)
    runtime_env = {"env_vars": env}
    if config.ray_address is not None:
        try:
            ray.init(address=config.ray_address, runtime_env=runtime_env, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise BackendConfigError(
                f"backend.verl.ray_address: cannot attach to {config.ray_address!r} ({error}); start it with "
                "`ray start --head`, or set ray_address: null"
            ) from None
    else:
        cpus = max(os.cpu_count() or 1, config.world_size)
        kwargs: dict[str, Any] = {"num_cpus": cpus, "include_dashboard": False, "runtime_env": runtime_env}
        if config.device == "cpu":
            kwargs["num_gpus"] = 0
        kwargs["log_to_driver"] = False
        ray.init(**kwargs)
    try:
        check_resources(config)
    except BaseException:
        ray.shutdown()
        raise
    return RayHandle(started_here=True)


def check_resources(config: VerlBackendConfig) -> None:
    """Fail with the key to change when the cluster cannot hold the workers (instead of hanging)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    resource = "GPU" if config.device == "cuda" else "CPU"
    fitting = [n for n in nodes if n.get("Resources", {}).get(resource, 0) >= config.n_gpus_per_node]
    if len(fitting) < config.nnodes:
        have = sorted(int(n.get("Resources", {}).get(resource, 0)) for n in nodes)
        raise BackendConfigError(
            f"backend.verl.n_gpus_per_node: {config.nnodes} node(s) with {config.n_gpus_per_node} {resource}(s) "
            f"each are needed, the Ray cluster has nodes with {have} {resource}s; lower nnodes / n_gpus_per_node "
            "or add nodes (`ray start --address HEAD:6379`)"
        )


def start_workers(config: VerlBackendConfig, settings) -> Any:
    """verl's RayWorkerGroup of AglTrainingWorker, one placement group per node."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from agl_trainer.backends.verl.worker import AglTrainingWorker

    on_gpu = config.device == "cuda"
    # verl's default names come from the `random` module, which training seeds: two backends in one
    # process would ask for the same placement group name
    prefix = f"agl{uuid.uuid4().hex[:8]}"
    pool = RayResourcePool(
        process_on_nodes=[config.n_gpus_per_node] * config.nnodes,
        use_gpu=on_gpu,
        name_prefix=prefix,
        max_colocate_count=1,  # one worker per bundle: a CPU bundle asks 1 CPU, not verl's default 10
    )
    cls = RayClassWithInitArgs(ray.remote(AglTrainingWorker), settings=settings)
    return RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=cls,
        name_prefix=prefix,
        device_name=config.device,
        worker_env=worker_env(config.device),
    )


def stop_workers(workers: Any) -> None:
    """Kill the group's actors and free their placement groups (a shared Ray gets its resources back)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for handle in getattr(workers, "_workers", []):
        with contextlib.suppress(Exception):  # an actor that already died is fine
            ray.kill(handle)
    pool = getattr(workers, "resource_pool", None)
    for group in getattr(pool, "pgs", None) or []:
        with contextlib.suppress(Exception):  # already removed
            remove_placement_group(group)
