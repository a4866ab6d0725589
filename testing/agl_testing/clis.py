"""The coding-agent CLIs from npm (Claude Code, Codex) at the versions testing/clis/package-lock.json
pins, installed by `make clis` into testing/clis/node_modules. `installed_cli` finds one and checks its
version, so a test runs the exact release the lock names or says why it cannot."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CLIS_DIR = Path(__file__).resolve().parents[1] / "clis"
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


@dataclass(frozen=True)
class Cli:
    name: str
    path: Path
    version: str  # the pinned version, which `--version` printed


def pinned_version(name: str) -> str:
    """The version of CLI `name` that testing/clis/package.json pins."""
    dependencies = json.loads((CLIS_DIR / "package.json").read_text())["dependencies"]
    return dependencies[PACKAGES[name]]


def installed_cli(name: str) -> Cli | str:
    """CLI `name` ("claude" or "codex") at its pinned version, or why it is not usable here."""
    version = pinned_version(name)
    path = CLIS_DIR / "node_modules" / ".bin" / name
    if not path.exists():
        how = "run `make clis` (npm install of testing/clis)"
        return f"{PACKAGES[name]}@{version} is not installed: {how}" + ("" if shutil.which("npm") else "; npm is missing")
    try:
        printed = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path} does not run: {exc}"
    if version not in printed:
        return f"{path} printed {printed.strip()!r}, not version {version}: run `make clis`"
    return Cli(name, path, version)
