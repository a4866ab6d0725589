from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.store import RolloutStore


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "rollouts.db"


@pytest.fixture
def receiver(store_path: Path) -> Iterator[Receiver]:
    with Receiver(store_path, ReceiverConfig(port=0, grpc_port=0)) as running:
        yield running


@pytest.fixture
def store(store_path: Path) -> Iterator[RolloutStore]:
    with RolloutStore(store_path, grace_s=0.0) as opened:
        yield opened
