"""The warm start lifts the demo model from random to about half the reward, as its own phase."""

from __future__ import annotations

from pathlib import Path

import pytest
from examples.demo.warmstart import Demonstration, WarmStartConfig


def test_warm_start_raises_reward_above_random(prepared) -> None:
    assert prepared.reward_init < 0.15  # random: about 1/25 per position
    assert prepared.reward_warm > 0.35  # measured 0.45-0.55: the format is learned, copying partly
    assert prepared.reward_warm > prepared.reward_init + 0.25
    assert (Path(prepared.path) / "model.safetensors").is_file()
    assert (Path(prepared.path) / "tokenizer.json").is_file()


def test_bad_demonstrations_and_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="same length"):
        Demonstration([1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="nothing to learn"):
        Demonstration([1, 2, 3], [1, 0, 0])
    with pytest.raises(ValueError, match="steps"):
        WarmStartConfig(steps=0)
    with pytest.raises(ValueError, match="lr"):
        WarmStartConfig(lr=0)
