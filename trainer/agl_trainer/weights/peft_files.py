"""peft's adapter format, spelled once: its file names, its weight-name prefix, the files read and
written. PeftModel.from_pretrained, vLLM's --lora-modules and agl's checkpoints all read these."""

from __future__ import annotations

import json
from pathlib import Path

from agl_trainer.weights.update import AdapterState

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # peft's weight names: base_model.model.<module>.lora_A.weight


def write_adapter(state: AdapterState, directory: Path) -> Path:
    """The adapter's two files in `directory` (made if missing): CPU copies of its weights, its config."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.weights.items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(state.config, indent=2, sort_keys=True))
    return directory


def read_adapter(directory: Path) -> AdapterState:
    """What write_adapter (or peft's save_pretrained) wrote."""
    from safetensors.torch import load_file

    weights, config = directory / ADAPTER_WEIGHTS, directory / ADAPTER_CONFIG
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"{directory} holds no peft adapter ({ADAPTER_WEIGHTS} and {ADAPTER_CONFIG})")
    return AdapterState(load_file(weights), json.loads(config.read_text()))
