"""A tiny random Qwen2 causal LM (built offline in milliseconds) and batches for it."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends.torch_config import TorchBackendConfig
from agl_trainer.batch import RolloutResult, Sample, TrainingBatch

VOCAB = 64
# a Llama-shaped model in milliseconds: Qwen2 here, Llama in the torch backend's architecture tests
TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def make_tiny_model(directory: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=True, **TINY_DIMS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"w{i}": i for i in range(VOCAB)}
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1").save_pretrained(
            directory
        )
    return directory


def training_config(model: Path, **overrides) -> TorchBackendConfig:
    """The backend's settings for a tiny model on the CPU (lr 1e-2 unless given)."""
    return TorchBackendConfig(
        model_path=model,
        device=overrides.pop("device", "cpu"),
        lr=overrides.pop("lr", 1e-2),
        algorithm=overrides.pop("algorithm", AlgorithmConfig()),
        **overrides,
    )


def sample(
    rollout_id: str,
    task_id: str,
    prompt: list[int],
    completion: list[int],
    version: int = 0,
    logprob: float = -4.0,
) -> Sample:
    n_prompt, n_completion = len(prompt), len(completion)
    return Sample(
        rollout_id=rollout_id,
        task_id=task_id,
        token_ids=prompt + completion,
        loss_mask=[0] * n_prompt + [1] * n_completion,
        engine_logprobs=[0.0] * n_prompt + [logprob] * n_completion,
        policy_versions=[-1] * n_prompt + [version] * n_completion,
    )


def random_batch(
    num_tasks: int, per_task: int, seed: int = 0, max_calls: int = 3, max_len: int = 24, version: int = 0
) -> TrainingBatch:
    """Rollouts of 1..max_calls samples with random tokens and rewards."""
    rng = random.Random(seed)
    rollouts = []
    for task in range(num_tasks):
        for attempt in range(per_task):
            rid = f"t{task}-r{attempt}"
            samples = []
            for _ in range(rng.randint(1, max_calls)):
                prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, max_len // 2))]
                completion = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, max_len // 2))]
                samples.append(
                    sample(rid, f"task{task}", prompt, completion, version, logprob=-rng.uniform(3, 5))
                )
            rollouts.append(RolloutResult(rid, f"task{task}", rng.random(), samples))
    return TrainingBatch.from_rollouts(rollouts)


def two_call_rollout(split: bool) -> RolloutResult:
    """Rollout "a" of task "t" (reward 1): two calls, the second's prompt extending the first's
    sequence exactly, as one merged sample or as two samples. Trained alike, they update alike."""
    prompt, first, tool, second = [3, 4, 5, 6], [20, 21, 22], [12, 13], [23, 24, 25, 26]
    if split:
        samples = [
            sample("a", "t", prompt, first, logprob=-3.0),
            sample("a", "t", prompt + first + tool, second, logprob=-3.5),
        ]
    else:
        merged = Sample(
            "a",
            "t",
            prompt + first + tool + second,
            [0] * 4 + [1] * 3 + [0] * 2 + [1] * 4,
            [0.0] * 4 + [-3.0] * 3 + [0.0] * 2 + [-3.5] * 4,
            [-1] * 4 + [0] * 3 + [-1] * 2 + [0] * 4,
        )
        samples = [merged]
    return RolloutResult("a", "t", 1.0, samples)
