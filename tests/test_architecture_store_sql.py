"""The store owns its schema: no product file outside `trainer/agl_trainer/store/` holds SQL that
reads or writes the store's tables (SELECT ... FROM, JOIN, INSERT/REPLACE INTO, UPDATE, DELETE FROM
a table store/schema.py creates). The viewer, the from-store cursor and the CLI read through
store/queries.py, so a schema change is made in one folder.

Read from the source (no module is imported): every string literal, implicit concatenations and
f-strings included, skipped left out. The run's `agreement.db` (store/agreement_log.py) is a file
of its own with its own table (`samples`), not the store's, so it is not one of the names checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "trainer" / "agl_trainer" / "store"
PRODUCT = (
    ROOT / "sdk" / "agl",
    ROOT / "sidecar" / "agl_sidecar",
    ROOT / "trainer" / "agl_trainer",
    ROOT / "integrations" / "agl_integrations",
)


def store_tables() -> set[str]:
    schema = (STORE / "schema.py").read_text(encoding="utf-8")
    return set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", schema))


def table_sql(tables: set[str]) -> re.Pattern[str]:
    names = "|".join(sorted(tables))
    target = rf"\s+(?:\w+\.)?(?:{names})\b"  # `s.calls`: the store attached under a schema name
    return re.compile(
        rf"\bSELECT\b.*?\bFROM{target}|\bJOIN{target}|\b(?:INSERT(?:\s+OR\s+\w+)?|REPLACE)\s+INTO{target}"
        rf"|\bUPDATE{target}|\bDELETE\s+FROM{target}",
        re.DOTALL,
    )


def literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal that is not a docstring; an f-string's holes read `{}`."""
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(v) for v in node.values)  # read once, as part of the f-string
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            found.append((node.lineno, "".join(str(p) for p in parts)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            found.append((node.lineno, node.value))
    return found


def sql_outside_store(roots: tuple[Path, ...], store: Path, tables: set[str]) -> list[str]:
    pattern = table_sql(tables)
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(store):
                continue
            for line, text in literals(path.read_text(encoding="utf-8")):
                if pattern.search(text):
                    out.append(f"{path.relative_to(root.parent)}:{line}: {' '.join(text.split())[:80]}")
    return out


def test_only_the_store_holds_sql_on_its_tables() -> None:
    tables = store_tables()
    assert {"calls", "rewards", "rollouts", "training_steps"} <= tables
    assert sql_outside_store(PRODUCT, STORE, tables) == []


def test_the_scan_sees_concatenated_and_formatted_sql_but_not_docstrings(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "ok.py").write_text('Q = "SELECT * FROM calls"\n')
    (tmp_path / "reader.py").write_text(
        '"""Reads SELECT x FROM calls in its docstring only."""\n'
        'A = ("SELECT rowid, attempt"\n     " FROM s.calls WHERE rowid > ?")\n'
        'B = f"UPDATE rollouts SET trained_step = {1}"\n'
        'C = "INSERT OR IGNORE INTO rewards VALUES (?)"\n'
        'D = "SELECT * FROM samples"  # another database\'s table\n'
        'E = "the calls FROM the harness"\n'
    )
    found = sql_outside_store((tmp_path,), tmp_path / "store", {"calls", "rewards", "rollouts"})
    assert [entry.split(":")[1] for entry in found] == ["2", "4", "5"]
