"""LoRA on the vLLM engine: the base served once, each policy version's adapter loaded in place.

With `engine.options.lora_rank > 0` (the loop sets it from backend.lora.rank) a server starts with

    --enable-lora --max-lora-rank R --max-loras 1 --served-model-name <name>-base
    --lora-modules '{"name": "<name>", "path": "<root>/current"}'

so the harness's model name is the adapter and no request is rewritten. `<root>/current` is a
symlink to the latest version's directory (peft's adapter_config.json + adapter_model.safetensors);
it starts at an adapter of zeros (the base itself, policy version 0), which the server
registers at start under a vLLM id (1 on a fresh server; the engine asks the workers). An update
writes `<root>/v<N>`, has every worker load it in place under that id (agl_load_adapter in
worker.py, through /collective_rpc, with the server paused as for full weights), points
`current` at it (what a restarted server registers) and removes older directories.

Why not vLLM's own `POST /v1/load_lora_adapter` with `load_inplace: true` (read in vLLM 0.32's
source: entrypoints/openai/models/serving.py, lora/worker_manager.py, v1/worker/gpu_input_batch.py):
the flag is stored in the served LoRARequest, so every later request carries it, and the worker's
LRUCacheWorkerLoRAManager.add_adapter then re-reads the adapter from that request's path on every
engine step. A request frozen (pause mode keep) or running across an update keeps the old request's
path: once it is the latest request of the batch, each step loads the old adapter back, or fails when
that directory is gone. Unloading and loading without the flag gives the adapter a new vLLM id, under
which frozen requests keep the old adapter. Loading in place through the worker keeps the id, and with
it every request in flight, while the served LoRARequest (load_inplace false) never reloads per step.

The prefix cache keys a LoRA request's blocks by the adapter's name and served path, which stay the
same across versions: the engine empties the cache after each update, as it does for full weights.
A full-weight update replaces the base and resets the adapter to the empty one, loaded in the same
pause (vLLM's reload_weights drops the workers' adapters), as the embedded engine treats full
weights as the new base for the next adapter.

An adapter may cover the output head (lm_head), tied to the input embedding or not: vLLM wraps the
head with LogitsProcessorWithLoRA, which adds the head's delta to the logits alone (the embedding
lookup stays the base's), as peft does.

Two vLLM 0.32 faults worked around (tests/vllm/test_vllm_lora.py checks both): an adapter without
weights fails to load (so the base-only adapter holds zeros on one layer, sized from the model's
config.json), and prompt_logprobs of two prompts or more with LoRA on kill the engine (vLLM adds the
head's delta with one LoRA index per request, not per prompt row: agl_patch_lora_logits in
worker.py gives each prompt row its token's index, and skips a head delta of zeros). The runtime
/v1/load_lora_adapter endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING) are not needed and stay off.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from agl_trainer.weights import peft_files
from agl_trainer.weights.update import AdapterState

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's --max-lora-rank choices
CURRENT = "current"
EMPTY = "v0-empty"


def max_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for choice in LORA_RANKS:
        if rank <= choice:
            return choice
    raise ValueError(f"engine.options.lora_rank: {rank} is above vLLM's largest rank, {LORA_RANKS[-1]}")


def base_model_name(adapter_name: str) -> str:
    """What the base is served as: vLLM refuses an adapter named as a served base model."""
    return f"{adapter_name}-base"


def server_arguments(rank: int, adapter_name: str, current: Path) -> list[str]:
    """The flags that serve the base under an internal name and the adapter under `adapter_name`."""
    base = base_model_name(adapter_name)
    module = json.dumps({"name": adapter_name, "path": str(current), "base_model_name": base})
    return [
        "--served-model-name", base,
        "--enable-lora", "--max-lora-rank", str(max_lora_rank(rank)),
        "--max-loras", "1",  # one adapter: its in-place load always lands in slot 0
        "--lora-modules", module,
    ]  # fmt: skip


def write_adapter(weights: dict[str, Any], config: dict[str, Any], directory: Path) -> Path:
    """An adapter in peft's format, written whole before the directory appears under its name (a
    worker reading `current` never sees half of one)."""
    partial = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    peft_files.write_adapter(AdapterState(weights, config), partial)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(partial, directory)
    return directory


def empty_adapter(model_dir: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """An adapter that changes nothing: A = B = 0 on layer 0's attention output projection, sized from
    the model's config.json (vLLM 0.32 fails on an adapter without weights: StopIteration in
    LoRAModelManager._create_merged_loras_inplace)."""
    import torch

    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(
            f"engine.options.lora_rank: {model_dir} has no config.json; with LoRA, model.path must be "
            "the base model's local directory (it sizes the adapter that serves the base alone)"
        )
    config = json.loads(path.read_text())
    config = config.get("text_config") or config
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    module = f"{peft_files.PEFT_PREFIX}model.layers.0.self_attn.o_proj"
    weights = {f"{module}.lora_A.weight": torch.zeros(rank, heads * head_dim),
               f"{module}.lora_B.weight": torch.zeros(hidden, rank)}  # fmt: skip
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["o_proj"], "bias": "none"}
    return weights, config


class AdapterFiles:
    """The adapter directories one engine writes under `root` (every replica reads the same files)."""

    def __init__(self, root: Path, rank: int, model_dir: Path) -> None:
        self.root = root
        self.rank = rank
        self.model_dir = model_dir
        self.current = root / CURRENT
        self.empty = root / EMPTY

    def prepare(self) -> None:
        """A fresh start: `current` at the empty adapter (none of an earlier run's versions)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_adapter(*empty_adapter(self.model_dir, self.rank), self.empty)
        self.reset()

    def write(self, version: int, weights: dict[str, Any], config: dict[str, Any]) -> tuple[Path, float]:
        """Version `version`'s directory, and the seconds writing it took."""
        rank = int(config.get("r", 0))
        if rank > max_lora_rank(self.rank):
            raise ValueError(
                f"the adapter has rank {rank}, but vLLM was started for rank {self.rank} "
                f"(--max-lora-rank {max_lora_rank(self.rank)}) (fix: set backend.lora.rank to the adapter's rank, {rank})"
            )
        started = time.perf_counter()
        directory = write_adapter(weights, config, self.root / f"v{version}")
        return directory, time.perf_counter() - started

    def point_at(self, directory: Path) -> None:
        """Swap `current` to `directory` atomically (a worker reading it sees the old or the new one)."""
        link = self.root / f".{CURRENT}.{os.getpid()}"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(directory.name)  # relative: the root may be mounted elsewhere on another host
        os.replace(link, self.current)

    def reset(self) -> None:
        """Back to no adapter (full weights replaced the base)."""
        self.point_at(self.empty)
        self.prune()

    def prune(self) -> None:
        """Remove every version directory but the one `current` points at (and the empty adapter)."""
        keep = {os.readlink(self.current), EMPTY, CURRENT}
        for path in self.root.iterdir():
            if path.name not in keep and path.name.startswith("v") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def versions(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink())
