"""A result's receipt: everything its score depends on, in receipt.json next to the results.

    model     path, a sha256 over its weight, config and tokenizer files (every regular file at the
              top of the directory, by name then bytes), or the served URL and the name asked for
    harness   the command (or module:function) and its version: `git describe --always --dirty`
              of the directory holding the program (the function's module) when that is a git
              checkout, and always a sha256 over the command line plus the bytes of every file
              the command names that exists (the function's module file)
    budget    k, turns (AGL_MAX_TURNS), context tokens (AGL_CONTEXT_TOKENS), tokens per call
              (sampling max_tokens), harness timeout and retries
    sampling  the mode, temperature, top_p and seed the attempts were sampled with
    tasks     the task file and its sha256;  agl: its version and the resolved config
    started_at / ended_at (UTC, ISO 8601);  machine: host, CPU, GPU, python, torch, platform

Two results are comparable when their `budget` and `sampling` agree (BUDGET_KEYS, SAMPLING_KEYS;
the seed may differ). Validation rounds in training write the same receipt (kind "validation").
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import msgspec

from agl_trainer.config import resolved_config
from agl_trainer.redaction import redact

SCHEMA = "agl.receipt/1"
RECEIPT_FILE = "receipt.json"
RESULTS_FILE = "results.json"
BUDGET_KEYS = ("k", "max_turns", "context_tokens", "max_tokens_per_call", "timeout_s", "retries")
SAMPLING_KEYS = ("mode", "temperature", "top_p")
ENV_MAX_TURNS = "AGL_MAX_TURNS"
ENV_CONTEXT_TOKENS = "AGL_CONTEXT_TOKENS"


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_hash(path: Path) -> tuple[str, int]:
    """sha256 over the directory's top-level regular files (name, then bytes), and how many."""
    if path.is_file():
        return sha256_file(path), 1
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file())
    for file in files:
        digest.update(file.name.encode() + b"\0" + bytes.fromhex(sha256_file(file)))
    return digest.hexdigest(), len(files)


def model_section(config: Any, model_path: str | None, served_url: str | None) -> dict[str, Any]:
    if served_url is not None:
        return {"url": served_url, "name": config.model.name, "sha256": None}
    path = Path(str(model_path))
    digest, count = model_hash(path)
    return {"path": str(path.resolve()), "name": config.model.name, "sha256": digest, "files": count}


def _git_describe(directory: Path) -> str | None:
    if shutil.which("git") is None or not directory.is_dir():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), "describe", "--always", "--dirty", "--tags"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def harness_section(config: Any) -> dict[str, Any]:
    from agl_trainer.config import harness_argv

    harness = config.harness
    cwd = Path(harness.cwd or ".")
    digest = hashlib.sha256()
    files: list[Path] = []
    if harness.function is not None:
        command: Any = harness.function
        digest.update(command.encode())
        import importlib.util

        module = harness.function.split(":", 1)[0]
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin) if spec is not None and spec.origin else cwd / (module.replace(".", "/") + ".py")
        if origin.is_file():  # runner workers import from the harness's cwd, this process may not
            files.append(origin)
    else:
        argv = harness_argv(harness.command) if harness.command else []
        command = argv
        digest.update("\0".join(argv).encode())
        for index, item in enumerate(argv):
            candidate = Path(item) if Path(item).is_absolute() else cwd / item
            if index == 0 and "/" not in item and shutil.which(item):
                candidate = Path(str(shutil.which(item)))
            if candidate.is_file():
                files.append(candidate)
    for file in files:
        digest.update(b"\0" + bytes.fromhex(sha256_file(file)))
    describe = _git_describe(files[0].parent) if files else _git_describe(cwd)
    return {
        "command": command,
        "grader": harness.grader,
        "runner": harness.runner,
        "image": harness.image,
        "version": {"git_describe": describe, "sha256": digest.hexdigest(), "files": [str(f) for f in files]},
    }


def machine_section() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    machine: dict[str, Any] = {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": None,
        "gpu": None,
    }
    try:
        import torch

        machine["torch"] = torch.__version__
        if torch.cuda.is_available():
            machine["gpu"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return machine


def agl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        described = _git_describe(Path(__file__).resolve().parent)
        return f"{version('agl')}" + (f" ({described})" if described else "")
    except PackageNotFoundError:
        return "unknown"


def build_receipt(
    config: Any,
    *,
    kind: str,
    model_path: str | None,
    served_url: str | None,
    tasks_path: str,
    k: int,
    mode: str,
    seed: int | None,
    started_at: str,
    ended_at: str,
    results: dict[str, Any],
    model: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    sampling = config.sampling.for_mode(mode)
    receipt = {
        "schema": SCHEMA,
        "kind": kind,
        "model": model if model is not None else model_section(config, model_path, served_url),
        "harness": harness_section(config),
        "budget": {
            "k": k,
            "max_turns": config.eval.max_turns,
            "context_tokens": config.eval.context_tokens,
            "max_tokens_per_call": sampling.max_tokens,
            "timeout_s": config.harness.timeout_s,
            "retries": config.harness.retries,
        },
        "sampling": {"mode": mode, "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed},
        "tasks": {"path": str(Path(tasks_path).resolve()), "sha256": sha256_file(Path(tasks_path))},
        "agl": {"version": agl_version(), "config": resolved_config(config)},
        "started_at": started_at,
        "ended_at": ended_at,
        "machine": machine_section(),
        "results": {"file": RESULTS_FILE, "summary": results.get("summary", {})},
    }
    receipt.update(extra or {})
    return receipt


def write_result(directory: Path, results: dict[str, Any], receipt: dict[str, Any], stem: str = "") -> Path:
    """results.json and receipt.json (or STEM.results.json / STEM.receipt.json) in `directory`;
    the receipt holds the results file's sha256. Returns the receipt's path."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"{stem}." if stem else ""
    results_path = directory / f"{prefix}{RESULTS_FILE}"
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    receipt["results"]["file"] = results_path.name
    receipt["results"]["sha256"] = sha256_file(results_path)
    receipt_path = directory / f"{prefix}{RECEIPT_FILE}"
    tmp = receipt_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(redact(receipt), indent=1, default=str) + "\n")  # shared, uploaded: no secrets
    os.replace(tmp, receipt_path)
    return receipt_path


class _ResultsRef(msgspec.Struct, forbid_unknown_fields=False):
    file: str
    sha256: str = ""


class _Receipt(msgspec.Struct, forbid_unknown_fields=False):
    """What --compare reads of a receipt, checked before anything is read from it."""

    schema: str
    results: _ResultsRef
    budget: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    tasks: dict[str, Any] = {}
    model: dict[str, Any] = {}


class _TaskRow(msgspec.Struct, forbid_unknown_fields=False):
    task_id: str
    mean: float


class _Results(msgspec.Struct, forbid_unknown_fields=False):
    summary: dict[str, float]
    tasks: list[_TaskRow]


def read_result(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(receipt, results) from a receipt file or a directory holding receipt.json, both checked:
    the receipt names a results file in its own folder and carries that file's sha256, which the
    file still has; either one's shape is what --compare reads. ValueError names what is wrong."""
    receipt_path = path / RECEIPT_FILE if path.is_dir() else path
    if not receipt_path.is_file():
        raise ValueError(f"{path}: no receipt (expected {receipt_path}: an agl eval output directory or its receipt)")
    receipt = _read_json(receipt_path, "receipt")
    if not isinstance(receipt, dict) or receipt.get("schema") != SCHEMA:
        raise ValueError(f"{receipt_path}: not an agl receipt (schema {SCHEMA} expected)")
    checked = _shaped(receipt, _Receipt, receipt_path, "receipt")
    name, digest = checked.results.file, checked.results.sha256
    folder = receipt_path.parent
    if not name or name != Path(name).name or name in (".", "..") or "/" in name:
        raise ValueError(
            f"{receipt_path}: results.file {name!r} must name a file in the receipt's own folder ({folder})"
        )
    results_path = folder / name
    if results_path.resolve().parent != folder.resolve():  # a link to a file elsewhere
        raise ValueError(f"{receipt_path}: results.file {name!r} leads out of the receipt's own folder ({folder})")
    if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise ValueError(
            f"{receipt_path}: the receipt carries no sha256 of its results (results.sha256 is {digest!r}); without "
            "it an edited results file cannot be told apart (fix: compare a receipt agl eval wrote, unedited)"
        )
    if not results_path.is_file():
        raise ValueError(f"{results_path}: the receipt's results cannot be read (no such file)")
    if sha256_file(results_path) != digest:
        raise ValueError(f"{results_path}: changed since its receipt was written (sha256 differs)")
    results = _read_json(results_path, "results file")
    _shaped(results, _Results, results_path, "results file")
    for row in results["tasks"]:
        for key, value in row.items():
            if key.startswith("pass@") and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ValueError(f"{results_path}: not an agl results file (a task's {key} is {value!r}, not a number)")
    return receipt, results


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except OSError as error:
        raise ValueError(f"{path}: the {what} cannot be read ({error.strerror or error})") from None
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested past the parser
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)[:200]
        raise ValueError(f"{path}: not a readable JSON {what} ({reason})") from None


def _shaped(document: Any, shape: type, path: Path, what: str) -> Any:
    try:
        return msgspec.convert(document, shape)
    except msgspec.ValidationError as error:
        raise ValueError(f"{path}: not an agl {what} ({error})") from None
