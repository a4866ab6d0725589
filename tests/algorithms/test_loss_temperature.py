"""backend.algorithm.loss_temperature on the torch backend: the loss trains softmax(logits / T), the
distribution rollouts sampled at T came from, while agreement and importance weights stay on the model's
own log-probs (temperature 1), the kind an engine reports."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import TorchBackend
from agl_trainer.batch import TrainingBatch

from tests.algorithms.tiny import TINY_DIMS, VOCAB, random_batch, training_config

T = 0.6


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen2 with an output head of its own, and the same model with that head divided by T:
    the second's logits are the first's divided by T, so its update at temperature 1 is what the
    first's at T must be."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    base = tmp_path_factory.mktemp("untied")
    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False, **TINY_DIMS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(base / "model")
    with torch.no_grad():
        model.lm_head.weight.div_(T)
    model.save_pretrained(base / "scaled")
    return base / "model", base / "scaled"


def backend(model: Path, temperature: float, **overrides) -> TorchBackend:
    algorithm = AlgorithmConfig(loss_temperature=temperature, **overrides.pop("algorithm", {}))
    options = {"lr": 1e-3, "max_grad_norm": None, **overrides}
    return TorchBackend(training_config(model, algorithm=algorithm, **options))


def gradients(trained: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in trained.model.named_parameters() if p.grad is not None}


def with_own_logprobs(batch: TrainingBatch, trained: TorchBackend) -> TrainingBatch:
    """The batch with the engine's log-probs set to what an exact engine serving this model reports:
    its own (temperature 1) log-probs."""
    own = trained.compute_logprobs(batch)
    return dataclasses.replace(batch, engine_logprobs=torch.where(batch.loss_mask.bool(), own, 0.0))


def test_compute_logprobs_at_a_temperature_is_the_scaled_softmax(models):
    model, scaled = models
    batch = random_batch(2, 2, seed=3)
    at_t = backend(model, T).compute_logprobs(batch, temperature=T)
    own = backend(model, T).compute_logprobs(batch)
    want = backend(scaled, 1.0).compute_logprobs(batch)
    trained = batch.loss_mask.bool()
    torch.testing.assert_close(at_t[trained], want[trained], atol=2e-5, rtol=1e-5)
    assert float((own[trained] - want[trained]).abs().max()) > 0.05  # the model's own differ


def test_the_update_at_a_temperature_is_the_scaled_models_update(models):
    """Policy loss, entropy bonus and metrics at T equal the scaled model's at 1; its gradient too, but
    for the head's (d/dW of f(Wh / T) is the scaled head's gradient / T)."""
    model, scaled = models
    batch = random_batch(3, 3, seed=5)
    algorithm = {"entropy_coef": 0.01}
    at_t, reference = backend(model, T, algorithm=algorithm), backend(scaled, 1.0, algorithm=algorithm)
    got, want = at_t.train_step(batch, 0), reference.train_step(batch, 0)
    assert abs(want["loss/total"]) > 1e-3
    for key in ("loss/total", "loss/pg", "actor/entropy", "actor/ratio_max", "actor/clip_frac"):
        assert got[key] == pytest.approx(want[key], abs=1e-5, rel=1e-4), key
    got_grads, want_grads = gradients(at_t), gradients(reference)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name, grad in got_grads.items():
        expected = want_grads[name] / T if name == "lm_head.weight" else want_grads[name]
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-4, msg=name)


def test_the_reference_and_the_old_logprobs_are_at_the_loss_temperature(models):
    """The KL reference (the initial model) is scored at T: at the first step it is the policy, KL 0.
    With two mini-batches PPO's old log-probs come from a pass before the update, at T too: the ratio
    stays 1 (the model's own old log-probs would put it far from 1), while agreement still compares
    the model's own log-probs with the engine's."""
    model, _ = models
    batch = random_batch(3, 2, seed=4)
    first = backend(model, T, algorithm={"kl_coef": 0.1}).train_step(batch, 0)
    assert first["actor/ref_kl"] == pytest.approx(0.0, abs=1e-7)
    # lr 1e-7: the second mini-batch's weights are the first's up to ~1e-7, so its ratio is 1 too
    epochs = backend(model, T, lr=1e-7, num_mini_batches=2)
    scored = with_own_logprobs(batch, backend(model, T))
    metrics = epochs.train_step(scored, 0)
    assert metrics["perf/optimizer_steps"] == 2
    assert metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-4) and metrics["actor/clip_frac"] == 0.0
    assert metrics["agreement/lag0/max_abs_delta"] < 1e-5  # the pre-update pass's own log-probs


def test_agreement_and_importance_weights_compare_the_models_own_logprobs(models):
    """An exact engine reports the model's own log-probs: agreement at lag 0 is exact, and stale
    tokens' importance weights are 1 (the trainer's log-probs at T would differ from them by up to
    nats)."""
    model, _ = models
    trained = backend(model, T)
    batch = with_own_logprobs(random_batch(2, 3, seed=6), trained)
    scaled_gap = (trained.compute_logprobs(batch, temperature=T) - batch.engine_logprobs)[batch.loss_mask.bool()]
    assert float(scaled_gap.abs().max()) > 0.1  # what a comparison at T would see
    current = trained.train_step(batch, policy_version=0)
    assert current["agreement/lag0/max_abs_delta"] < 1e-5
    stale = backend(model, T, algorithm={"importance_cap": 1.5}).train_step(batch, policy_version=1)
    assert stale["importance/stale_token_frac"] == 1.0
    assert stale["importance/max"] == pytest.approx(1.0, abs=1e-5)
    assert stale["importance/capped_frac"] == 0.0
