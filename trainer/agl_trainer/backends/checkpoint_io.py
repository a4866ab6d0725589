"""Files and process state for checkpoints and weight hand-off: atomic directories, tokenizer files, RNG."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def copy_tokenizer_files(source: Path, target: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (target / name).exists():
            shutil.copy2(source / name, target / name)


def atomic_directory(directory: Path, write) -> None:
    """Build the directory beside its destination, then swap it in, so a crash never leaves half a save."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        write(tmp)
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_loaded(model: torch.nn.Module, weights: dict[str, torch.Tensor], result) -> None:
    """Missing keys are fine only when tied to a loaded tensor (e.g. lm_head to embed_tokens)."""
    state = model.state_dict()
    loaded_ptrs = {state[name].data_ptr() for name in weights if name in state}
    missing = [name for name in result.missing_keys if state[name].data_ptr() not in loaded_ptrs]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing}, unexpected "
            f"{list(result.unexpected_keys)}; was it saved from another model_path?"
        )
