"""A tiny random Qwen2 causal LM (built offline in milliseconds) and batches for it."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from agl_trainer.batch import RolloutResult, Sample, TrainingBatch

VOCAB = 64


def make_tiny_model(directory: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
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
