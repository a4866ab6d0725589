"""The architecture's rules, read from the source (no module is imported).

- the sidecar and the trainer never import each other (they talk HTTP and OTLP only);
- the SDK (`import agl`) imports neither of them, nor torch, litellm, verl or transformers anywhere
  (that `import agl` loads none of them is also checked at run time in tests/sdk/test_process.py);
- the store owns the record types and never imports the receiver (the receiver imports the store);
- in the trainer, `agl_trainer.loop.sidecar_client` alone starts the sidecar program and names its
  admin API; the rest of the trainer goes through it;
- no file of the repository points at a file outside it (a sibling folder of the checkout, an
  absolute path into the folder that holds it): what the project needs, it carries.
"""

from __future__ import annotations

import ast
import os
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "sidecar" / "agl_sidecar"
TRAINER = ROOT / "trainer" / "agl_trainer"
SDK = ROOT / "sdk" / "agl"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, absolute names (relative imports resolved against `package`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def violations(folder: Path, forbidden: tuple[str, ...]) -> list[str]:
    """`file: module` for each import under `folder` of a module in (or below) `forbidden`."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        package = ".".join(path.relative_to(folder.parent).parts[:-1])  # the module's own package
        for module in imported_modules(path.read_text(encoding="utf-8"), package):
            if any(module == name or module.startswith(name + ".") for name in forbidden):
                out.append(f"{path.relative_to(folder.parent)}: {module}")
    return sorted(set(out))


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        (SIDECAR, ("agl_trainer",)),
        (TRAINER, ("agl_sidecar",)),
        (SDK, ("agl_sidecar", "agl_trainer", "torch", "litellm", "verl", "transformers")),
        (TRAINER / "store", ("agl_trainer.receiver",)),
    ],
    ids=["sidecar-not-trainer", "trainer-not-sidecar", "sdk-none-of-them", "store-not-receiver"],
)
def test_import_rule(folder: Path, forbidden: tuple[str, ...]) -> None:
    assert folder.is_dir(), folder
    assert violations(folder, forbidden) == []


def test_the_scan_sees_absolute_relative_and_nested_imports() -> None:
    source = (
        "import agl_trainer.store\n"
        "from agl_sidecar import proxy\n"
        "def f():\n    from ..receiver import wire\n"
        "if True:\n    import torch as t\n"
    )
    found = imported_modules(source, "agl_trainer.store")
    assert {"agl_trainer.store", "agl_sidecar", "agl_sidecar.proxy", "agl_trainer.receiver.wire", "torch"} <= found


# --- the trainer reaches the sidecar through loop/sidecar_client.py only ----------------------------
SIDECAR_CLIENT = TRAINER / "loop" / "sidecar_client.py"
ADMIN_NAMES = {"ADMIN_PAUSE_PATH", "ADMIN_RESUME_PATH", "ADMIN_STATE_PATH"}  # agl.semconv's admin paths


def sidecar_contacts(source: str) -> list[str]:
    """`line: what` where `source` starts the sidecar program or names its admin API: semconv's admin
    path names, a string holding an /agl/v1/ path, the program's name ("agl-sidecar", the agl_sidecar
    module). Docstrings do not count."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.alias):
            name = node.name
        else:
            name = None
        if name in ADMIN_NAMES:
            found.append(f"{node.lineno}: {name}")  # type: ignore[attr-defined]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            if "/agl/v1/" in text or text in ("agl-sidecar", "agl_sidecar") or text.startswith("agl_sidecar."):
                found.append(f"{node.lineno}: {text!r}")
    return found


def test_only_the_sidecar_client_starts_and_drives_the_sidecar() -> None:
    assert sidecar_contacts(SIDECAR_CLIENT.read_text(encoding="utf-8"))  # the one home is where it says
    elsewhere = {
        str(path.relative_to(ROOT)): contacts
        for path in sorted(TRAINER.rglob("*.py"))
        if path != SIDECAR_CLIENT and (contacts := sidecar_contacts(path.read_text(encoding="utf-8")))
    }
    assert elsewhere == {}, "use agl_trainer.loop.sidecar_client (SidecarProcess, SidecarAdmin)"


def test_the_sidecar_scan_sees_names_strings_and_imports_but_not_docstrings() -> None:
    source = (
        '"""Pauses through POST /agl/v1/pause."""\n'
        "from agl.semconv import ADMIN_STATE_PATH\n"
        "def f(c):\n"
        '    """Resumes through /agl/v1/resume."""\n'
        "    return c.post(semconv.ADMIN_PAUSE_PATH)\n"
        "URL = f'http://x/agl/v1/{what}'\n"
        "ARGV = [sys.executable, '-m', 'agl_sidecar.cli']\n"
    )
    found = [entry.split(": ", 1)[1] for entry in sidecar_contacts(source)]
    assert sorted(found) == sorted(["ADMIN_STATE_PATH", "ADMIN_PAUSE_PATH", "'http://x/agl/v1/'", "'agl_sidecar.cli'"])


# --- nothing points outside the repository ----------------------------------------------------------
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".json", ".jinja"}
TEXT_NAMES = {"Makefile", "Dockerfile"}
SKIPPED_DIRS = {"build", "dist", "node_modules", "__pycache__", "runs"}  # and hidden ones (.git, .venv); runs/: outputs
CLIMB = re.compile(r"(?:\.\./)+[\w.-]+(?:/[\w.-]+)*")


def repository_files(root: Path) -> list[Path]:
    """The project's text files below `root` (not build outputs, caches or virtual environments)."""
    out = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [
            d for d in subfolders if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info"))
        ]
        for name in names:
            path = Path(folder) / name
            if (path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES) and path.stat().st_size <= 2_000_000:
                out.append(path)
    return sorted(out)


def outside_pointers(root: Path, path: Path) -> list[str]:
    """Paths in `path`'s text that climb out of `root` to something that is there (read from the
    file's folder, or from `root`, where the project's commands run), and absolute paths into the
    folder that holds `root`."""
    text = path.read_text(encoding="utf-8", errors="replace")
    found = []
    for match in CLIMB.finditer(text):
        for base in (path.parent, root):
            target = (base / match.group()).resolve()
            if not target.is_relative_to(root) and target.exists():
                found.append(match.group())
                break
    # The folder that holds the checkout, unless it is the system's scratch space: a clone in /tmp
    # must not turn the project's own scratch paths (/tmp/agl-peer-..., made by its scripts) into
    # pointers outside it.
    holder = str(root.parent).rstrip("/") + "/"
    scratch = str(Path(tempfile.gettempdir()).resolve()).rstrip("/") + "/"
    if holder not in ("/", scratch) and holder in text:
        found.append(holder)
    return found


def test_no_file_points_outside_the_repository() -> None:
    pointers = {
        str(path.relative_to(ROOT)): found for path in repository_files(ROOT) if (found := outside_pointers(ROOT, path))
    }
    assert pointers == {}, "carry what the project needs inside the repository"


def test_the_outside_scan_sees_a_sibling_folder_and_not_a_missing_one(tmp_path: Path) -> None:
    root, sibling = tmp_path / "repo", tmp_path / "shared"
    climb = "../" * 2 + "shared/DESIGN.md"  # spelled in two pieces, or this file would break the rule
    (root / "docs").mkdir(parents=True)
    (root / ".venv").mkdir()
    (root / ".venv" / "x.py").write_text(climb)  # not the project's
    sibling.mkdir()
    (sibling / "DESIGN.md").write_text("x")
    doc = root / "docs" / "a.md"
    doc.write_text(f"see {climb}; a rollout id such as ../escape is refused")
    assert outside_pointers(root, doc) == [climb]
    doc.write_text(f"read {sibling}/DESIGN.md")
    assert outside_pointers(root, doc) == [f"{tmp_path}/"]
    assert repository_files(root) == [doc]
