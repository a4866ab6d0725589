"""What `agl export` reads and writes: the checkpoint a path names, the merged model (the base's
safetensors shards, each adapted weight + scaling x B @ A, one shard in memory at a time) and the bare
adapter (peft's files, copied). Every user error is an ExportError naming the problem and the fix."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from agl_trainer.backends.checkpoint_io import atomic_directory, copy_tokenizer_files
from agl_trainer.loop.checkpoint import RUN_FILE, Checkpoints
from agl_trainer.weights.merge import adapter_deltas
from agl_trainer.weights.peft_files import ADAPTER_CONFIG, PEFT_PREFIX, read_adapter
from agl_trainer.weights.tied_head import HEAD_WEIGHT, config_for_weights, ties_head
from agl_trainer.weights.update import AdapterState

Kind = Literal["lora", "full", "verl"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODEL_FILES = ("config.json", "generation_config.json")  # beside the weights and the tokenizer's files
INDEX = "model.safetensors.index.json"


class ExportError(Exception):
    """Printed by the CLI as `agl: error: ...`."""


@dataclass(frozen=True)
class Source:
    backend_dir: Path  # what the backend's save_checkpoint wrote: adapter/ or model/ (or verl/)
    kind: Kind


def export(
    source: Path,
    out: Path,
    *,
    merged: bool,
    adapter: bool | None,
    base: Path | None = None,
    dtype: str = "auto",
    force: bool = False,
) -> list[str]:
    """Write what was asked (adapter None: the adapter where the checkpoint has one) and return
    what was written, one line each."""
    found = find_checkpoint(source)
    if found.kind == "verl":
        raise ExportError(
            f"{found.backend_dir} is a verl (FSDP-sharded) checkpoint; verl's own tool merges its shards "
            "into a model directory (fix: python -m verl.model_merger merge --backend fsdp --local_dir "
            f"{found.backend_dir / 'verl'} --target_dir {out})"
        )
    if found.kind == "full" and adapter:
        raise ExportError(
            f"--adapter: {found.backend_dir} is a full-training checkpoint (backend.lora.rank was 0), it "
            "holds no adapter (fix: leave out --adapter; the model is exported as trained)"
        )
    with_adapter = found.kind == "lora" and adapter is not False
    _check_out(out, found.backend_dir, force)
    torch_dtype = None if dtype == "auto" else DTYPES[dtype]
    lines = [f"checkpoint {found.backend_dir.parent}: {_describe(found)}"]
    if found.kind == "full":
        model_dir = found.backend_dir / "model"
        state, base_dir = None, model_dir
    else:
        state = _read_adapter(found.backend_dir / "adapter")
        base_dir = base_model(found.backend_dir, base) if merged else None
    adapter_dir = out / "adapter" if merged else out

    def write(tmp: Path) -> None:
        if merged:
            assert base_dir is not None
            size = write_model(base_dir, tmp, state, torch_dtype)
            what = "merged model (base + adapter)" if state else "model"
            base_note = f", base {base_dir}" if state else ""
            lines.append(f"{what} -> {out} ({_size(size)}{base_note}): transformers and vllm serve load it")
        if with_adapter:
            target = tmp / "adapter" if merged else tmp
            target.mkdir(parents=True, exist_ok=True)
            for file in sorted((found.backend_dir / "adapter").iterdir()):
                if file.is_file():
                    shutil.copy2(file, target / file.name)
            assert state is not None
            lines.append(
                f"adapter (peft format) -> {adapter_dir} ({_size(state.nbytes)}): "
                "PeftModel.from_pretrained(base, path), "
                "or vllm serve BASE --enable-lora --lora-modules NAME=path"
            )

    atomic_directory(out, write)
    return lines


def _size(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB" if nbytes >= 1024**3 else f"{nbytes / 1024**2:.1f} MiB"


# ------------------------------------------------------------------------------------ the source
def find_checkpoint(source: Path) -> Source:
    """The backend directory `source` names: itself, its backend/, or the latest checkpoint of a
    checkpoints/ directory or of a run's output_dir."""
    if not source.exists():
        raise ExportError(f"{source} does not exist (fix: a run's output_dir or a checkpoint directory)")
    if not source.is_dir():
        raise ExportError(
            f"{source} is a file, not a checkpoint (fix: a run's output_dir or checkpoints/step_N)"
        )
    candidates = [source, source / "backend"]
    for root in (source, source / "checkpoints"):
        latest = Checkpoints(root).latest()
        if latest is not None:
            candidates.append(latest / "backend")
    for candidate in candidates:
        kind = _kind(candidate)
        if kind is not None:
            return Source(candidate, kind)
    if (source / RUN_FILE).is_file() or (source / "checkpoints").is_dir():
        raise ExportError(
            f"{source} holds a run but no complete checkpoint (checkpoints/latest) (fix: export once the run "
            "has saved one, every loop.checkpoint_every steps)"
        )
    raise ExportError(
        f"{source} is not a checkpoint: no adapter/ or model/ (fix: a run's output_dir, its checkpoints/, "
        "a checkpoint checkpoints/step_N, or that checkpoint's backend/)"
    )


def _kind(directory: Path) -> Kind | None:
    if (directory / "adapter" / ADAPTER_CONFIG).is_file():
        return "lora"
    if (directory / "model" / "config.json").is_file() and any((directory / "model").glob("*.safetensors")):
        return "full"
    if (directory / "verl").is_dir():
        return "verl"
    return None


def _describe(found: Source) -> str:
    if found.kind == "full":
        return "full weights"
    config = json.loads((found.backend_dir / "adapter" / ADAPTER_CONFIG).read_text())
    targets = config.get("target_modules")
    names = ", ".join(sorted(targets)) if isinstance(targets, list) else str(targets)
    return f"LoRA adapter, rank {config.get('r')}, alpha {config.get('lora_alpha')}, on {names}"


def _read_adapter(directory: Path) -> AdapterState:
    try:
        return read_adapter(directory)
    except FileNotFoundError as error:
        raise ExportError(f"{error} (fix: the checkpoint is incomplete; export an earlier one)") from None


def base_model(backend_dir: Path, given: Path | None) -> Path:
    """The model a LoRA run trained: `given`, else the one its checkpoint records."""
    if given is not None:
        if not (given / "config.json").is_file():
            raise ExportError(f"--base {given}: no config.json there (fix: the Hugging Face model directory)")
        return given
    recorded = _recorded_base(backend_dir)
    if recorded is None or not (recorded / "config.json").is_file():
        raise ExportError(
            f"the base model of {backend_dir.parent} ({recorded or 'not recorded'}) is not there "
            "(fix: --base MODEL_DIR, the model the run trained)"
        )
    return recorded


def _recorded_base(backend_dir: Path) -> Path | None:
    """model_path from trainer_state.pt (the backend's settings), else peft's base_model_name_or_path."""
    state_path = backend_dir / "trainer_state.pt"
    if state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False, mmap=True)
        path = (state.get("config") or {}).get("model_path")
        if path:
            return Path(path)
    config = json.loads((backend_dir / "adapter" / ADAPTER_CONFIG).read_text())
    name = config.get("base_model_name_or_path")
    return Path(name) if name else None


def _check_out(out: Path, backend_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file (fix: a directory path)")
    resolved, checkpoint = out.resolve(), backend_dir.resolve()
    if resolved == checkpoint or resolved in checkpoint.parents or checkpoint in resolved.parents:
        raise ExportError(
            f"--out {out} is inside or around the checkpoint it reads (fix: a directory elsewhere)"
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(
            f"--out {out} exists and is not empty (fix: another --out, or --force to replace it)"
        )


# ------------------------------------------------------------------------------------ the model
def write_model(
    source: Path, target: Path, adapter: AdapterState | None, dtype: torch.dtype | None
) -> int:
    """The model in `source` (safetensors + config + tokenizer) into `target`, each weight the adapter
    adapts merged in float32 and rounded once; returns the weights' bytes written."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise ExportError(f"{source} holds no *.safetensors (fix: a model saved with safetensors as --base)")
    adapted = _per_weight(adapter) if adapter is not None else {}
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    tied_to = _tied_head_source(source, shapes) if HEAD_WEIGHT in adapted else None
    if tied_to is not None:  # a tied head merged with its adapter: a weight of its own, beside the embedding
        shapes[HEAD_WEIGHT] = shapes[tied_to]
    missing = sorted(set(adapted) - set(shapes))
    if missing:
        raise ExportError(
            f"the adapter adapts {', '.join(missing[:3])}, which {source} does not have "
            "(fix: --base the model the run trained)"
        )
    total = 0
    head_shard = None
    for shard in shards:
        tensors = load_file(shard)
        if tied_to in tensors:
            tensors[HEAD_WEIGHT] = tensors[tied_to]
            head_shard = shard.name
        for name, tensor in tensors.items():
            if name in adapted:
                (delta,) = adapter_deltas(adapted[name]).values()
                if tuple(delta.shape) != shapes[name]:
                    raise ExportError(
                        f"the adapter's update of {name} has shape {tuple(delta.shape)}, {source} has "
                        f"{shapes[name]} (fix: --base the model the run trained)"
                    )
                tensors[name] = (tensor.float() + delta).to(dtype or tensor.dtype)
            elif dtype is not None:
                tensors[name] = tensor.to(dtype)
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(target / shard.name), metadata={"format": "pt"})
        del tensors
    _copy_metadata(source, target, dtype, total, head_shard)
    return total


def _tied_head_source(source: Path, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The weight a tied output head shares (the input embedding), where the model ties its head and
    so stores no lm_head; None where the head is a weight of its own."""
    if HEAD_WEIGHT in shapes:
        return None
    config = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else {}
    embeddings = [name for name in shapes if name.endswith("embed_tokens.weight")]
    if not ties_head(config) or len(embeddings) != 1:
        raise ExportError(
            f"the adapter adapts {HEAD_WEIGHT}, which {source} neither has nor ties to one input "
            "embedding (fix: --base the model the run trained)"
        )
    return embeddings[0]


def _per_weight(adapter: AdapterState) -> dict[str, AdapterState]:
    """The adapter split by the base weight each A, B pair updates (its Hugging Face name), so one
    update at a time is in memory (an 8B model's, all at once in float32, are ~28 GB)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.weights.items():
        module = name.rpartition(".lora_")[0]
        pairs.setdefault(module.removeprefix(PEFT_PREFIX) + ".weight", {})[name] = tensor
    return {weight: AdapterState(part, adapter.config) for weight, part in pairs.items()}


def _copy_metadata(
    source: Path, target: Path, dtype: torch.dtype | None, total: int, head_shard: str | None = None
) -> None:
    """config.json and the rest beside the weights; `head_shard`: the shard a tied head, merged with its
    adapter, went to (the config then unties it, the index lists it)."""
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    if head_shard is not None and (target / "config.json").is_file():
        config = json.loads((target / "config.json").read_text())
        config = config_for_weights(config, [HEAD_WEIGHT])
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dtype is not None and (target / "config.json").is_file():
        config = json.loads((target / "config.json").read_text())
        keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
        config.update({key: str(dtype).removeprefix("torch.") for key in keys})
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (source / INDEX).is_file():
        index = json.loads((source / INDEX).read_text())
        index.setdefault("metadata", {})["total_size"] = total
        if head_shard is not None:
            index.setdefault("weight_map", {})[HEAD_WEIGHT] = head_shard
        (target / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    copy_tokenizer_files(source, target)
