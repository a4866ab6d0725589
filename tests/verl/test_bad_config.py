"""A verl config that cannot work fails in build_backend before Ray or any worker starts, and the
message names the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from agl_trainer.backends import BackendConfigError
from agl_trainer.backends.verl import VerlBackendConfig
from agl_trainer.config import ConfigError, load_config
from agl_trainer.run.build import build_backend

from tests.algorithms.tiny import training_config
from tests.support.ports import free_port


CASES = [
    (
        ["--loop.batch_rollouts=2", "--loop.group_size=2", "--backend.verl.n_gpus_per_node=4"],
        "backend.verl.n_gpus_per_node: data-parallel size 4",
        "lower n_gpus_per_node or nnodes, or raise loop.batch_rollouts",
    ),
    (["--backend.verl.param_offload=true"], "backend.verl.param_offload", "needs CUDA GPUs"),
    (
        ["--backend.verl.optimizer_offload=true"],
        "backend.verl.optimizer_offload",
        "run on GPUs with device: cuda",
    ),
    (["--backend.verl.weight_sync=nccl"], "backend.verl.weight_sync: 'nccl' needs CUDA GPUs", "remove it"),
    (["--backend.verl.weight_sync=cuda_ipc"], "backend.verl.weight_sync: 'cuda_ipc'", "remove it"),
    (
        ["--backend.verl.ulysses_sequence_parallel_size=2", "--backend.verl.n_gpus_per_node=2"],
        "backend.verl.ulysses_sequence_parallel_size",
        "needs CUDA GPUs",
    ),
    (
        ["--set", 'backend.verl.override={"engine.no_such_field": 1}'],
        "backend.verl.override",
        "has no field 'no_such_field'",
    ),
    (["--set", 'backend.options={"lr_schedule": "cosine"}'], "backend.total_steps", "set it"),
]


@pytest.fixture
def base(tmp_path: Path, tiny_model: Path) -> list[str]:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n')
    return [
        f"--tasks={tasks}",
        f"--model.path={tiny_model}",
        "--harness.function=m:f",
        "--backend.name=verl",
        "--backend.device=cpu",
        "--loop.batch_rollouts=8",
        "--loop.group_size=4",
        f"--output_dir={tmp_path / 'out'}",
    ]


@pytest.mark.parametrize(
    ("flags", "key", "fix"), CASES, ids=[c[1].split(":")[0] + str(i) for i, c in enumerate(CASES)]
)
def test_bad_config_fails_before_workers_start(base, flags, key, fix):
    import ray

    config = load_config(None, [*base, *flags], check_paths=False)
    with pytest.raises(ConfigError) as error:
        build_backend(config, str(config.model.path))
    message = str(error.value)
    assert message.startswith("config key ") and key in message and fix in message, message
    assert not ray.is_initialized()


def test_missing_model_path(base, tmp_path):
    config = load_config(None, base, check_paths=False)
    with pytest.raises(ConfigError, match="config key backend.model_path: .* is not a directory"):
        build_backend(config, str(tmp_path / "no-model"))


def test_cuda_device_on_a_machine_without_cuda(tiny_model):
    with pytest.raises(
        BackendConfigError, match="backend.device: 'cuda', but CUDA is not available here.*use device: cpu"
    ):
        VerlBackendConfig(
            training=training_config(tiny_model, device="cuda"), n_gpus_per_node=2, cuda_available=False
        )
    # the same on a GPU machine is fine (validation only; nothing starts)
    config = VerlBackendConfig(
        training=training_config(tiny_model, device="cuda"), n_gpus_per_node=2, cuda_available=True
    )
    assert config.device == "cuda"


def test_unreachable_ray_address(tiny_model):
    import ray

    port = free_port()  # a port where nothing answers
    with pytest.raises(
        BackendConfigError,
        match=rf"backend.verl.ray_address: '127.0.0.1:{port}': nothing answers.*ray start --head",
    ):
        VerlBackendConfig(
            training=training_config(tiny_model), ray_address=f"127.0.0.1:{port}", cuda_available=False
        )
    with pytest.raises(BackendConfigError, match="backend.verl.ray_address: 'nohost': not HOST:PORT"):
        VerlBackendConfig(training=training_config(tiny_model), ray_address="nohost", cuda_available=False)
    assert not ray.is_initialized()


def test_cluster_too_small_for_the_workers(tiny_model):
    """Checked against the cluster's resources right after attaching, before any worker is placed."""
    import ray
    from agl_trainer.backends.verl.backend import VerlBackend

    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        config = VerlBackendConfig(
            training=training_config(tiny_model), n_gpus_per_node=3, cuda_available=False
        )
        with pytest.raises(
            BackendConfigError,
            match=r"backend.verl.n_gpus_per_node: 1 node\(s\) with 3 CPU.*nodes with \[1\] CPUs",
        ):
            VerlBackend(config)
    finally:
        ray.shutdown()
