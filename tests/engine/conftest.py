"""Engine fixtures: tiny models built once per session, an engine started per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions
from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model


@pytest.fixture(scope="session")
def bpe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the fixtures' model: 2 layers, hidden 128, head_dim 64, tied embeddings, max_model_len 512
    spec = TinyModelSpec(hidden=128, heads=2, kv_heads=2, intermediate=256, max_positions=512)
    return build_bpe_model(tmp_path_factory.mktemp("bpe") / "model", spec)


@pytest.fixture(scope="module")
def engine(bpe_model_dir: Path) -> Iterator[EmbeddedEngine]:
    with EmbeddedEngine(
        EmbeddedEngineConfig(model_path=bpe_model_dir, served_model_name="tiny", options=EmbeddedOptions(max_model_len=512))
    ) as running:
        yield running


@pytest.fixture(scope="module")
def base_url(engine: EmbeddedEngine) -> str:
    return engine.urls[0]
