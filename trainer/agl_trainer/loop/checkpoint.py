"""Checkpoints of the whole loop: backend state plus the loop's own (step, policy version, which
rollouts the saved weights have been trained on). The policy version is saved here only: backends
keep no version of their own (train_step is told it), so resume restores it from loop.json.

Order matters for "no rollout trained twice, none lost": a step's rollouts are marked trained in
the store only after a checkpoint that includes them is on disk. If the trainer dies in between,
`--resume` finds them in the checkpoint's `trained_since_previous` and marks them then; rollouts
trained after the last checkpoint are not marked, so the resumed run trains them again into the
weights it actually resumed from.

Layout: OUTPUT_DIR/checkpoints/step_000012/{backend/, loop.json}; `latest` names the newest
complete one (written last, atomically), so a crash mid-save leaves the previous one in force.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from agl_trainer.config import ConfigError

RUN_FILE = "run.json"  # in output_dir: the run's id; its presence says a run lives there

KEEP = 2


@dataclass
class LoopState:
    step: int = 0
    policy_version: int = 0
    next_group_index: int = 0
    # (rollout id, attempt) of each rollout trained since the previous checkpoint
    trained_since_previous: list[tuple[str, int]] = field(default_factory=list)
    run_id: str = ""


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        directory = self.root / pointer.read_text().strip()
        return directory if (directory / "loop.json").exists() else None

    def save(self, state: LoopState, backend: Any) -> Path:
        name = f"step_{state.step:06d}"
        final = self.root / name
        partial = self.root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        backend.save_checkpoint(partial / "backend")
        (partial / "loop.json").write_text(json.dumps(asdict(state)))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        tmp = self.root / "latest.tmp"
        tmp.write_text(name)
        os.replace(tmp, self.root / "latest")
        self._prune(keep=name)
        return final

    def record_trained(self, step: int, keys: list[Any]) -> None:
        """Append to trained.jsonl, the audit trail of what the kept weights were trained on."""
        line = json.dumps({"step": step, "rollouts": [[k.rollout_id, k.attempt] for k in keys]})
        with open(self.root.parent / "trained.jsonl", "a", encoding="utf-8") as handle:
            handle.write(line + "\n")

    def trained_ledger(self) -> list[tuple[int, str, int]]:
        """(step, rollout id, attempt) for every rollout in trained.jsonl."""
        path = self.root.parent / "trained.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # cut short by a crash
            out += [(entry["step"], rid, attempt) for rid, attempt in entry["rollouts"]]
        return out

    def load(self, directory: Path) -> LoopState:
        data = json.loads((directory / "loop.json").read_text())
        known = {f.name for f in fields(LoopState)}  # older checkpoints carry a field since removed
        state = LoopState(**{name: value for name, value in data.items() if name in known})
        state.trained_since_previous = [(rid, attempt) for rid, attempt in state.trained_since_previous]
        return state

    def _prune(self, keep: str) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[:-KEEP]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)


def open_run_dir(out: Path, resume: bool) -> tuple[Checkpoints, Path | None]:
    """output_dir made ready for a run (on-policy or from a store): its checkpoints and, with
    --resume, the latest one. A new run refuses a folder that holds one; --resume needs one."""
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(out / "checkpoints")
    latest = checkpoints.latest() if resume else None
    if resume and latest is None and not (out / RUN_FILE).exists():
        raise ConfigError(f"--resume: nothing to resume in {out} (fix: run without --resume first)")
    if not resume and (out / RUN_FILE).exists():
        raise ConfigError(
            f"output_dir {out} already holds a run (fix: --resume to continue it, or another output_dir)"
        )
    return checkpoints, latest
