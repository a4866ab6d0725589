"""Shared pieces of the verl backend tests: a tiny model, a local Ray shared by a module, backend pairs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.algorithms.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("verl-tiny") / "model")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray for a test module (backends attach to it and leave it running); shut down after."""
    import ray
    from agl_trainer.backends.verl.cluster import worker_env

    if ray.is_initialized():
        ray.shutdown()
    env = worker_env("cpu")
    ray.init(
        num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env}
    )
    yield
    ray.shutdown()
