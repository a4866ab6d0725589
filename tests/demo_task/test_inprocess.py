"""The in-process RL reference: one step samples, rewards and updates; RL lifts the reward."""

from __future__ import annotations

import pytest

from examples.demo.inprocess import InProcessRL, _rows, demo_lora_targets, time_step


def test_a_step_samples_rewards_and_updates(prepared) -> None:
    rl = InProcessRL(prepared.path, tasks_per_step=4, episodes_per_task=4, seed=1)
    before = {k: v.clone() for k, v in rl.model.state_dict().items()}
    stats = rl.step()
    assert 0.0 <= stats.reward <= 1.0
    assert stats.seconds >= stats.sample_s + stats.train_s - 1e-6
    changed = [k for k, v in rl.model.state_dict().items() if not (v == before[k]).all()]
    assert changed  # the update moved the weights


def test_both_calls_merge_into_one_row_when_the_prompt_extends() -> None:
    from examples.demo.episodes import Episode

    episode = Episode(
        {}, [1, 4, 9, 2, 1, 5], [7, 9, 2], [1, 4, 9, 2, 1, 5, 7, 9, 2, 1, 6, 20, 2, 1, 5], [20, 2], 1.0
    )
    [(ids, mask)] = _rows(episode)
    assert [t for t, m in zip(ids, mask) if m] == [7, 9, 2, 20, 2]
    broken = Episode(
        {}, [1, 4, 9, 2, 1, 5], [7, 1, 2], [1, 4, 9, 2, 1, 5, 7, 2, 1, 6, 20, 2, 1, 5], [20, 2], 1.0
    )
    assert len(_rows(broken)) == 2  # a special token in the text breaks the extension


def test_time_step_measures_a_full_step(prepared) -> None:
    assert time_step(prepared.path, steps=2, tasks_per_step=4, episodes_per_task=4) > 0


@pytest.mark.slow
def test_rl_lifts_the_reward_after_the_warm_start(prepared) -> None:
    rl = InProcessRL(prepared.path, seed=0)
    rewards = [rl.step().reward for _ in range(120)]
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert end > 0.75 and end > start + 0.2, (start, end)


def test_lora_trains_the_adapters_on_the_demo_configs_targets(prepared) -> None:
    rl = InProcessRL(prepared.path, tasks_per_step=4, episodes_per_task=4, seed=1, lora_rank=4)
    assert "lm_head" in demo_lora_targets()  # the tiny model's skill is in its (tied) output head
    before = {k: v.clone() for k, v in rl.model.state_dict().items()}
    rl.step()
    changed = {k for k, v in rl.model.state_dict().items() if not (v == before[k]).all()}
    assert changed and all("lora_" in k for k in changed), changed  # the tied embedding stays the base's
    assert "base_model.model.lm_head.lora_B.default.weight" in changed  # B starts at 0 and moves first
