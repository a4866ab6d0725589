"""Demo fixtures: the demo's tiny model, at random and after the warm start, built once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from examples.demo.prepare import PreparedModel, prepare_demo_model


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> PreparedModel:
    return prepare_demo_model(tmp_path_factory.mktemp("demo"), seed=0, progress=False)


@pytest.fixture(scope="module")
def demo_engine(prepared: PreparedModel) -> Iterator[object]:
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    with EmbeddedEngine(EmbeddedEngineConfig(model_path=prepared.path, served_model_name="tiny")) as engine:
        yield engine
