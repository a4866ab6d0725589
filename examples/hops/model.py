"""The hops model: the demo's tiny model shape over the demo's words plus `main` (the main agent's
system message). `build_hops_model("runs/hops/model-init", seed=0)` -> the directory."""

from __future__ import annotations

from pathlib import Path

from agl_trainer.models.tiny import TinyModelSpec, build_word_level_model

from examples.demo.model import DEMO_SPEC
from examples.hops.task import WORDS


def build_hops_model(directory: str | Path, seed: int = 0) -> Path:
    return build_word_level_model(directory, WORDS, TinyModelSpec(**{**DEMO_SPEC.__dict__, "seed": seed}))
