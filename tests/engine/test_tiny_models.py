"""Tiny models build offline and load by path with the tokenizer they were built with."""

from __future__ import annotations

from pathlib import Path

import pytest
from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model, build_word_level_model
from transformers import AutoModelForCausalLM, AutoTokenizer

WORDS = ["call", "k0", "k1", "v0", "v1", "none"]


def test_word_level_model_round_trips_through_save_and_load(tmp_path: Path) -> None:
    path = build_word_level_model(
        tmp_path / "m", WORDS, TinyModelSpec(hidden=64, layers=2, heads=1, kv_heads=1)
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim == 64 and model.config.tie_word_embeddings
    assert model.get_input_embeddings().num_embeddings == len(tokenizer) == 3 + 4 + len(WORDS)
    ids = tokenizer("call k1 v0", add_special_tokens=False)["input_ids"]
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids] == ["call", "k1", "v0"]
    assert tokenizer("unknownword")["input_ids"] == [tokenizer.unk_token_id]
    # what an engine decodes, re-rendered by the chat template, gives back the same tokens
    generated = [*ids, tokenizer.eos_token_id]
    text = tokenizer.decode(generated, skip_special_tokens=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "k1"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    later = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "k1"},
            {"role": "assistant", "content": text},
            {"role": "tool", "content": "v1"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    later_ids = tokenizer(later, add_special_tokens=False)["input_ids"]
    assert later_ids[: len(prompt_ids) + len(generated)] == prompt_ids + generated


def test_chat_template_renders_every_role_and_tool_calls(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build_word_level_model(tmp_path / "m", WORDS))
    messages = [
        {"role": "system", "content": "none"},
        {"role": "user", "content": "k0"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "k0", "arguments": "v0"}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "v1"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nnone<|im_end|>\n<|im_start|>user\nk0<|im_end|>\n"
        "<|im_start|>assistant\n call k0 v0<|im_end|>\n<|im_start|>tool\nv1<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bpe_model_loads_with_its_own_tokenizer(tmp_path: Path) -> None:
    path = build_bpe_model(tmp_path / "bpe")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "The quick brown fox: what is 2 + 2?"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: lossless
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    import torch

    def weights(name: str, seed: int) -> torch.Tensor:
        path = build_word_level_model(tmp_path / name, WORDS, TinyModelSpec(seed=seed))
        return AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight

    assert torch.equal(weights("a", 1), weights("b", 1))
    assert not torch.equal(weights("a", 1), weights("c", 2))


def test_bad_specs_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelSpec(hidden=32)
    with pytest.raises(ValueError, match="architecture"):
        TinyModelSpec(architecture="gpt2")
    with pytest.raises(ValueError, match="llama"):
        build_word_level_model("/nonexistent", WORDS, TinyModelSpec(architecture="qwen2"))
