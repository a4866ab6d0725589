"""The architecture's import rules, read from the source with `ast` (no module is imported).

- the sidecar and the trainer never import each other (they talk HTTP and OTLP only);
- the SDK (`import agl`) imports neither of them; its heavy-dependency rule (no torch, litellm, ...
  loaded by `import agl`) is checked at run time in tests/sdk/test_process.py;
- the store owns the record types and never imports the receiver (the receiver imports the store).
"""

from __future__ import annotations

import ast
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
        (SDK, ("agl_sidecar", "agl_trainer")),
        (TRAINER / "store", ("agl_trainer.receiver",)),
    ],
    ids=["sidecar-not-trainer", "trainer-not-sidecar", "sdk-neither", "store-not-receiver"],
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
