"""A model's size from its directory, without loading it: parameter count and KV-cache bytes per token.

    arch = read_architecture("models/qwen3-8b")     # config.json (a `text_config` inside is used)
    arch.parameters                                 # counted from the architecture fields
    safetensors_parameters("models/qwen3-8b")       # exact, from the safetensors headers (or None)
    arch.kv_bytes_per_token(2)                      # 2 * layers * kv_heads * head_dim * dtype bytes

The count covers the decoder-only layout shared by Llama, Mistral, Qwen2 and Qwen3 (embedding,
per layer attention q/k/v/o + gated MLP + two RMSNorms, final norm, an untied lm_head), with the
family's biases (Qwen2: q/k/v; Llama/Qwen3: `attention_bias`, `mlp_bias`) and Qwen3's per-head q/k
norms. Other model types fall back to the same layout, and the report says it assumed it; shipped
weights (safetensors headers) always win over the estimate.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KNOWN_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}  # fmt: skip
SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024  # the format's own cap on the JSON header


class ArchitectureError(ValueError):
    """config.json is missing, unreadable, or lacks a field the count needs; says which and the fix."""


@dataclass(frozen=True)
class Architecture:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int | None
    torch_dtype: str | None

    @property
    def known_layout(self) -> bool:
        return self.model_type in KNOWN_TYPES

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_parameters(self) -> int:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.o_bias:
            attention += h
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def parameters(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_parameters
        return self.embedding_parameters + self.num_hidden_layers * self.layer_parameters + self.hidden_size + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token (what vLLM's paged cache stores per token)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def read_architecture(model_dir: str | Path) -> Architecture:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ArchitectureError(
            f"{path} does not exist (fix: model.path must be a Hugging Face model directory with a config.json)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArchitectureError(f"{path} is not readable JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ArchitectureError(f"{path} must hold a JSON object")
    return architecture_from_dict(raw, source=str(path))


def architecture_from_dict(raw: dict[str, Any], source: str = "config.json") -> Architecture:
    text = raw.get("text_config")
    fields = {**raw, **text} if isinstance(text, dict) else raw  # multimodal configs nest the LM
    model_type = str(fields.get("model_type") or raw.get("model_type") or "unknown")

    def number(name: str, default: int | None = None) -> int:
        value = fields.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArchitectureError(
                f"{source}: {name} is {value!r}; the parameter count needs it as a positive integer "
                "(fix: a complete config.json of the model)"
            )
        return value

    hidden = number("hidden_size")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ArchitectureError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim_value = fields.get("head_dim")
    head_dim = number("head_dim") if head_dim_value is not None else hidden // heads
    attention_bias = bool(fields.get("attention_bias", False))
    max_positions = fields.get("max_position_embeddings")
    dtype = fields.get("torch_dtype") or fields.get("dtype") or raw.get("torch_dtype")
    return Architecture(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_hidden_layers=number("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=number("vocab_size"),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(fields.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=max_positions if isinstance(max_positions, int) and max_positions > 0 else None,
        torch_dtype=str(dtype) if dtype else None,
    )


def safetensors_parameters(model_dir: str | Path) -> int | None:
    """Parameters stored in the directory's *.safetensors files (headers only: no tensor is read),
    or None when there are none. A header that cannot be parsed is an error naming the file."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        for name, entry in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ArchitectureError(f"{file}: tensor {name!r} has no valid shape in the safetensors header")
            total += math.prod(shape)
    return total


def _safetensors_header(file: Path) -> dict[str, Any]:
    try:
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ArchitectureError(f"{file}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > SAFETENSORS_HEADER_LIMIT:
                raise ArchitectureError(f"{file}: header length {length} is not a safetensors header")
            header = json.loads(handle.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArchitectureError(f"{file}: unreadable safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise ArchitectureError(f"{file}: the safetensors header is not a JSON object")
    return header


def dtype_bytes(name: str | None, default: int) -> int:
    if name is None:
        return default
    return DTYPE_BYTES.get(str(name).lower().removeprefix("torch."), default)
