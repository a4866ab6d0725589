"""Scale-out: an existing Ray cluster of two (simulated) nodes, attached by address like one from
`ray start --head`; nnodes=2 x n_gpus_per_node=1 puts one worker on each node and trains across both."""

from __future__ import annotations

import pytest
import torch
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig

from tests.algorithms.tiny import random_batch, training_config


@pytest.fixture
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1, num_gpus=0)
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_a_step_runs_across_two_nodes(two_node_cluster, tiny_model):
    import ray

    config = training_config(tiny_model)
    backend = VerlBackend(
        VerlBackendConfig(training=config, nnodes=2, n_gpus_per_node=1, ray_address=two_node_cluster.address)
    )
    try:
        assert len({info["node_id"] for info in backend.ranks}) == 2  # one worker per node
        assert backend.dp_size == 2
        batch = random_batch(num_tasks=2, per_task=2, seed=4, version=0)
        want = TorchBackend(config).train_step(batch, policy_version=1)
        got = backend.train_step(batch, policy_version=1)
        assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], abs=1e-5)
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-5)
        weights = backend.state_dict_for_engine()
        assert all(torch.isfinite(t).all() for t in weights.values())
    finally:
        backend.close()
    assert not ray.is_initialized()  # the backend attached, so it detached; the cluster is the fixture's
