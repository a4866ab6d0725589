"""The architecture's rules, read from the source (no module is imported).

- the sidecar and the trainer never import each other (they talk HTTP and OTLP only);
- the SDK (`import agl`) imports neither of them, nor torch, litellm, verl or transformers anywhere
  (that `import agl` loads none of them is also checked at run time in tests/sdk/test_process.py);
- the store owns the record types and never imports the receiver (the receiver imports the store);
- the training loop (`loop/`: the algorithm, written against the protocols of loop/ports.py) never
  imports the run's wiring (`run/`: what builds the parts and starts the processes), nor an engine,
  a backend or a runner beyond their base protocols, nor an HTTP client (the canary asks the engine
  through loop.ports.ProbeEngine);
- weights sit between backends and engines: engines never import a backend (the update and adapter
  types, peft's files and the merge are `agl_trainer.weights`), and `weights/` imports neither;
  an engine's modules live in its package (`engines/embedded/`, `engines/vllm/`), none flat;
- the layers below the wiring never reach up: the viewer reads no part of the loop, `eval/` (scores
  and receipts) never imports `run/` (`run/evaluation.py` runs an evaluation and imports `eval/`),
  `metrics/` never imports `eval/`, and `runners/` never imports `agl_trainer.config` (run/build.py
  builds a runner from the config; a runner takes the typed values it needs);
- no import circles between product modules (sdk, sidecar, trainer, integrations), counting imports
  under TYPE_CHECKING and inside functions;
- in the trainer, `agl_trainer.run.sidecar_client` alone starts the sidecar program and names its
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
        (
            TRAINER / "loop",
            ("agl_trainer.run", "agl_trainer.cli", "agl_trainer.receiver", "agl_trainer.engines.embedded",
             "agl_trainer.engines.vllm", "agl_trainer.backends.torch_backend", "agl_trainer.backends.verl",
             "agl_trainer.runners.local", "agl_trainer.runners.workers", "agl_trainer.runners.kubernetes",
             "agl_trainer.engines.probes", "httpx", "aiohttp", "requests", "urllib", "http.client"),
        ),  # fmt: skip
        (TRAINER / "viewer", ("agl_trainer.loop",)),
        (TRAINER / "eval", ("agl_trainer.run",)),
        (TRAINER / "metrics", ("agl_trainer.eval",)),
        (TRAINER / "runners", ("agl_trainer.config",)),
        (TRAINER / "engines", ("agl_trainer.backends",)),
        (TRAINER / "weights", ("agl_trainer.backends", "agl_trainer.engines", "agl_trainer.loop", "agl_trainer.run")),
    ],
    ids=["sidecar-not-trainer", "trainer-not-sidecar", "sdk-none-of-them", "store-not-receiver", "loop-not-wiring",
         "viewer-not-loop", "eval-not-run", "metrics-not-eval", "runners-not-config", "engines-not-backends",
         "weights-below-both"],
)
def test_import_rule(folder: Path, forbidden: tuple[str, ...]) -> None:
    assert folder.is_dir(), folder
    assert violations(folder, forbidden) == []


def test_each_engine_is_a_package_with_no_flat_modules_left() -> None:
    engines = TRAINER / "engines"
    assert (engines / "embedded" / "engine.py").is_file() and (engines / "vllm" / "engine.py").is_file()
    flat = sorted(p.name for p in engines.glob("*.py") if p.name.startswith(("embedded", "vllm")))
    assert flat == [], "an engine's module belongs in its package: engines/embedded/ or engines/vllm/"


def test_the_scan_sees_absolute_relative_and_nested_imports() -> None:
    source = (
        "import agl_trainer.store\n"
        "from agl_sidecar import proxy\n"
        "def f():\n    from ..receiver import wire\n"
        "if True:\n    import torch as t\n"
    )
    found = imported_modules(source, "agl_trainer.store")
    assert {"agl_trainer.store", "agl_sidecar", "agl_sidecar.proxy", "agl_trainer.receiver.wire", "torch"} <= found



# --- no import circles between product modules ------------------------------------------------------
PRODUCT = (SDK, SIDECAR, TRAINER, ROOT / "integrations" / "agl_integrations")
# Circles known when this check came, each to be removed; none is left. A new one fails the test.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def module_files(roots: tuple[Path, ...]) -> dict[str, Path]:
    """Module name -> file for every .py below `roots` (a package is its __init__.py)."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_imports(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (module `name`) imports: at the top, under
    TYPE_CHECKING or inside a function alike. `from p import m` is an import of p.m when m is a
    module, else of p; a name below a module (p.m.f) is an import of p.m."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of two or more modules (each module in one, if any)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            members = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.add(member)
                if member == module:
                    break
            if len(members) > 1:
                found.add(frozenset(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def product_circles() -> set[frozenset[str]]:
    files = module_files(PRODUCT)
    known = set(files)
    return circles(
        {name: module_imports(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", known)
         for name, path in files.items()}
    )  # fmt: skip


def test_no_import_circles_between_product_modules() -> None:
    found = product_circles()
    new = sorted(sorted(circle) for circle in found - KNOWN_CIRCLES)
    assert new == [], "an import circle (TYPE_CHECKING and function-local imports count): move what both need"
    gone = sorted(sorted(circle) for circle in KNOWN_CIRCLES - found)
    assert gone == [], "these circles are gone: take them off KNOWN_CIRCLES"


def test_the_circle_scan_sees_type_checking_and_function_local_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import f\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\ndef f(): ...\n")
    (package / "b.py").write_text("def g():\n    from pkg import c\nclass B: ...\n")
    (package / "c.py").write_text("from . import a\n")
    (package / "d.py").write_text("from pkg.a import f\nimport pkg.c\n")  # imports into the circle: not in it
    files = module_files((package,))
    graph = {name: module_imports(path.read_text(), name, path.name == "__init__.py", set(files)) for name, path in files.items()}
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.c"}  # `from pkg import c`: the module
    assert circles(graph) == {frozenset({"pkg.a", "pkg.b", "pkg.c"})}

# --- the trainer reaches the sidecar through run/sidecar_client.py only ----------------------------
SIDECAR_CLIENT = TRAINER / "run" / "sidecar_client.py"
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
    assert elsewhere == {}, "use agl_trainer.run.sidecar_client (SidecarProcess, SidecarAdmin)"


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
