"""Both backends implement the methods the loop's `Backend` protocol declares (the loop calls them
directly, no getattr), with the protocol's parameters."""

from __future__ import annotations

import inspect

import pytest
from agl_trainer.backends import TorchBackend
from agl_trainer.loop.ports import Backend

DECLARED = [name for name, value in inspect.getmembers(Backend) if not name.startswith("_") and callable(value)]


def test_the_protocol_declares_what_the_loop_and_the_session_call() -> None:
    assert {"train_step", "state_dict_for_engine", "save_checkpoint", "load_checkpoint", "close"} <= set(DECLARED)
    assert {"vocab_size", "last_logprobs", "uses_lora"} <= set(Backend.__annotations__)


def _verl_backend() -> type:
    from agl_trainer.backends.verl import VerlBackend

    return VerlBackend


@pytest.mark.parametrize("load", [lambda: TorchBackend, _verl_backend], ids=["torch", "verl"])
def test_backend_implements_the_protocol(load) -> None:
    backend = load()
    for name in DECLARED:
        implemented = getattr(backend, name, None)
        assert implemented is not None, f"{backend.__name__} lacks {name}"
        want = list(inspect.signature(getattr(Backend, name)).parameters)
        got = list(inspect.signature(implemented).parameters)
        assert got[: len(want)] == want, f"{backend.__name__}.{name}{got} does not take {want}"
    assert hasattr(backend, "uses_lora"), f"{backend.__name__} does not say whether it trains adapters"
