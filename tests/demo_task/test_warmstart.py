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


def test_a_schedule_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        WarmStartConfig(schedule="linear")
    with pytest.raises(ValueError, match=r"warmup_steps must be in \[0, steps=10\), got 10"):
        WarmStartConfig(steps=10, warmup_steps=10)


def test_the_cosine_schedule_rises_then_falls_to_zero_at_the_last_step() -> None:
    config = WarmStartConfig(steps=12, lr=1.0, schedule="cosine", warmup_steps=1)
    rates = [config.lr_at(step) for step in range(12)]
    assert rates[0] == pytest.approx(0.5)  # warmup: (step + 1) / (warmup + 1)
    assert rates[1] == pytest.approx(1.0) and rates[-1] == pytest.approx(0.0, abs=1e-12)
    assert rates[6] == pytest.approx(0.5)  # halfway through the cosine (steps 1-11): cos(pi / 2)
    assert all(a >= b for a, b in zip(rates[1:], rates[2:]))
    assert [WarmStartConfig(steps=3, lr=2.0).lr_at(step) for step in range(3)] == [2.0, 2.0, 2.0]


def test_the_warm_start_trains_at_the_scheduled_rate(tmp_path: Path) -> None:
    """A cosine run of 2 steps takes its second at rate 0, so it ends where a constant run of 1 step
    does (the same first batch, AdamW without weight decay); a constant run of 2 does not."""
    import torch
    from agl_trainer.models.tiny import TinyModelSpec, build_word_level_model
    from examples.demo.warmstart import supervised_warm_start
    from transformers import AutoModelForCausalLM

    init = build_word_level_model(tmp_path / "init", ["a", "b", "c"], TinyModelSpec(seed=1))
    demos = [Demonstration([3, 4, 5, 6, 4, 5], [0, 1, 1, 1, 1, 1]), Demonstration([5, 4, 3], [0, 1, 1])]

    def weights(name: str, steps: int, schedule: str) -> dict[str, torch.Tensor]:
        config = WarmStartConfig(steps=steps, lr=1e-2, batch_size=1, schedule=schedule)
        path = supervised_warm_start(init, tmp_path / name, demos, config, progress=False).path
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()

    one, cosine, two = weights("one", 1, "constant"), weights("cosine", 2, "cosine"), weights("two", 2, "constant")
    assert all(torch.equal(one[k], cosine[k]) for k in one)
    assert not all(torch.equal(one[k], two[k]) for k in one)
