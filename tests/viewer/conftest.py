from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agl_trainer.viewer import Viewer, ViewerServer

from tests.support.waiting import wait_until
from tests.viewer.stores import build, save_tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("viewer")
    return build(folder / "rollouts.db"), save_tokenizer(folder / "tokenizer")


def start(store: Path, model: Path | None = None, **kwargs: Any) -> ViewerServer:
    server = ViewerServer(Viewer(store, model=None if model is None else str(model), **kwargs), "127.0.0.1:0").start()
    indexer = server.viewer.indexer
    if indexer is not None:
        wait_until(lambda: indexer.done, "the viewer's indexer to catch up")
    return server


@pytest.fixture(scope="module")
def server(built: tuple[Path, Path]) -> Iterator[ViewerServer]:
    store, tokenizer = built
    with start(store, tokenizer) as running:
        yield running


def get(server: ViewerServer, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(server.url + path.lstrip("/"), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
