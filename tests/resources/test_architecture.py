"""The parameter count from config.json against an independent count: a transformers model built
from the same config (random weights, offline) and sum(p.numel()); and the safetensors headers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agl_trainer.resources import ArchitectureError, architecture_from_dict, read_architecture, safetensors_parameters

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 131}
CASES = {
    "llama-mha-tied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-gqa-untied-biases": (
        "llama",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
         "attention_bias": True, "mlp_bias": True},
    ),
    "qwen2-gqa-tied": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-gqa-untied": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen3-gqa-untied-head-dim": (
        "qwen3",
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    ),
    "qwen3-tied": ("qwen3", {"num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "mistral-gqa": ("mistral", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}),
}  # fmt: skip


def transformers_model(model_type: str, fields: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **BASE, **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


@pytest.mark.parametrize("case", sorted(CASES))
def test_count_matches_a_built_model(case: str) -> None:
    model_type, fields = CASES[case]
    model = transformers_model(model_type, fields)
    raw = json.loads(model.config.to_json_string())
    assert architecture_from_dict(raw).parameters == unique_numel(model)


@pytest.mark.parametrize("case", ["llama-mha-tied", "qwen2-gqa-untied"])
def test_safetensors_headers_match_and_win(case: str, tmp_path: Path) -> None:
    model_type, fields = CASES[case]
    model = transformers_model(model_type, fields)
    model.save_pretrained(tmp_path)
    assert safetensors_parameters(tmp_path) == unique_numel(model)
    assert read_architecture(tmp_path).parameters == unique_numel(model)


def test_directory_without_weights_has_no_safetensors_count(tmp_path: Path) -> None:
    assert safetensors_parameters(tmp_path) is None


def test_kv_bytes_per_token() -> None:
    arch = architecture_from_dict({**BASE, "model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32})
    assert arch.kv_bytes_per_token(2) == 2 * 2 * 2 * 32 * 2


def test_shipped_qwen3_8b_config() -> None:
    """examples/swe/model-config is Qwen3-8B: 8,190,735,360 parameters (its safetensors total)."""
    arch = read_architecture(Path(__file__).parents[2] / "examples" / "swe" / "model-config")
    assert arch.parameters == 8_190_735_360
    assert arch.kv_bytes_per_token(2) == 147_456


def test_nested_text_config_is_read() -> None:
    inner = {**BASE, "model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2}
    assert architecture_from_dict({"model_type": "x-vl", "text_config": inner}).parameters == architecture_from_dict(inner).parameters


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**BASE, "num_attention_heads": 0}, "num_attention_heads is 0"),
        ({k: v for k, v in BASE.items() if k != "vocab_size"} | {"num_attention_heads": 2}, "vocab_size is None"),
        ({**BASE, "num_attention_heads": 4, "num_key_value_heads": 3}, "not a multiple"),
        ({**BASE, "num_attention_heads": "4"}, "num_attention_heads is '4'"),
    ],
)
def test_bad_config_is_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ArchitectureError, match=message):
        architecture_from_dict(raw)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ArchitectureError, match="config.json does not exist"):
        read_architecture(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArchitectureError, match="not readable JSON"):
        read_architecture(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ArchitectureError, match="not a safetensors header"):
        safetensors_parameters(tmp_path)
