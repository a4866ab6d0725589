"""Weights as safetensors files, the form both engines read (a save_pretrained directory) and the vLLM
engine writes for its servers."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def read_safetensors(directory: Path) -> dict[str, Any]:
    """Every *.safetensors file of `directory`, as one state_dict (FileNotFoundError when none)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def write_safetensors(state_dict: Mapping[str, object], directory: Path) -> Path:
    """Write CPU tensors as one safetensors file. Tensors that share storage (tied embeddings)
    are written once, under their first name: vLLM ties them again when it loads."""
    import torch
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        assert isinstance(tensor, torch.Tensor), f"{name} is not a tensor"
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, directory / "model.safetensors")
    return directory


def default_weights_root() -> Path:
    """A new directory for written weights: under /dev/shm (tmpfs, no disk I/O) where writable."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="agl-weights-", dir=base))
