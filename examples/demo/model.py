"""The demo's tiny model: `build_demo_model("runs/demo/model-init")` -> the directory.

A Llama-shaped model (hidden 64, 2 layers, one head of 64, tied embeddings, about 133k
parameters) over the task's word-level vocabulary (26 tokens with the ChatML specials), random
weights from `seed`. Built offline in well under a second.
"""

from __future__ import annotations

from pathlib import Path

from agl_trainer.models.tiny import TinyModelSpec, build_word_level_model

from examples.demo.task import WORDS

DEMO_SPEC = TinyModelSpec(hidden=64, layers=2, heads=1, kv_heads=1, intermediate=256, max_positions=128)


def build_demo_model(directory: str | Path, seed: int = 0) -> Path:
    spec = TinyModelSpec(**{**DEMO_SPEC.__dict__, "seed": seed})
    return build_word_level_model(directory, WORDS, spec)
