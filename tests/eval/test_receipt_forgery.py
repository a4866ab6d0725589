"""`agl eval --compare` against receipts that were edited: a receipt must carry its results' sha256,
its results file must be a file in the receipt's own folder, and a malformed receipt or results file
is a clear error (exit 2, `agl: error: ...`), never a traceback."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.cli import main
from agl_trainer.eval.receipt import RECEIPT_FILE, RESULTS_FILE

from tests.eval.test_scores import fake_result


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    return fake_result(tmp_path / "a", rewards=[0.0, 1.0]).parent, fake_result(tmp_path / "b", rewards=[1.0, 0.0]).parent


def _edit_receipt(directory: Path, edit: Any) -> None:
    path = directory / RECEIPT_FILE
    receipt = json.loads(path.read_text())
    edit(receipt)
    path.write_text(json.dumps(receipt))


def _compare(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["eval", "--compare", str(a), str(b)])
    captured = capsys.readouterr()
    return code, captured.err


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r["results"].pop("sha256"),
        lambda r: r["results"].update(sha256=None),
        lambda r: r["results"].update(sha256=""),
        lambda r: r["results"].update(sha256=7),
        lambda r: r["results"].update(sha256="not hex"),
    ],
    ids=["removed", "null", "empty", "a-number", "not-hex"],
)
def test_a_receipt_without_its_digest_is_refused(tmp_path, capsys, edit):
    # Before: the sha256 was checked only when present; removed, null or empty, an edited score passed.
    a, b = _pair(tmp_path)
    results = b / RESULTS_FILE
    results.write_text(results.read_text().replace('"mean": 0.5', '"mean": 0.999'))  # the forgery
    _edit_receipt(b, edit)
    code, err = _compare(a, b, capsys)
    assert code == 2 and "agl: error:" in err and "sha256" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "name",
    ["/etc/hostname", "../a/results.json", "sub/results.json", "..", ".", "", "results.json/"],
)
def test_the_results_file_must_be_in_the_receipts_own_folder(tmp_path, capsys, name):
    a, b = _pair(tmp_path)
    (b / "sub").mkdir()
    (b / "sub" / RESULTS_FILE).write_text((b / RESULTS_FILE).read_text())
    _edit_receipt(b, lambda r: r["results"].update(file=name))
    code, err = _compare(a, b, capsys)
    assert code == 2 and "results.file" in err and "folder" in err


def test_a_results_file_linked_from_elsewhere_is_refused(tmp_path, capsys):
    a, b = _pair(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text((b / RESULTS_FILE).read_text())
    (b / "linked.json").symlink_to(elsewhere)
    _edit_receipt(b, lambda r: r["results"].update(file="linked.json"))
    code, err = _compare(a, b, capsys)
    assert code == 2 and "results.file" in err


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (keys and list indices)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


def _replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    copied = copy.deepcopy(document)
    holder = copied
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = value
    return copied


WRONG = [None, "x", -1, 1.5, [], {}, True, [[{}]]]


@pytest.mark.parametrize("which", [RECEIPT_FILE, RESULTS_FILE])
def test_any_value_of_the_wrong_kind_is_an_error_not_a_traceback(tmp_path, capsys, which):
    a, b = _pair(tmp_path)
    path = b / which
    original = json.loads(path.read_text())
    receipt_text = (b / RECEIPT_FILE).read_text()
    for where in _paths(original):
        for value in WRONG:
            path.write_text(json.dumps(_replaced(original, where, value)))
            if which == RESULTS_FILE:  # the digest follows, so only the shape is at fault
                _edit_receipt(b, lambda r: r["results"].update(sha256=_sha256(path)))
            code = main(["eval", "--compare", str(a), str(b)])
            err = capsys.readouterr().err
            assert code in (0, 1, 2), (where, value)
            assert code != 2 or err.startswith("agl: error:"), (where, value, err)
            (b / RECEIPT_FILE).write_text(receipt_text)


@pytest.mark.parametrize(
    "text",
    [b"[]", b"null", b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000, b'{"schema": "agl.receipt/1"}'],
    ids=["a-list", "null", "not-utf8", "deep", "schema-only"],
)
def test_a_malformed_receipt_is_a_clear_error(tmp_path, capsys, text):
    a, b = _pair(tmp_path)
    (b / RECEIPT_FILE).write_bytes(text)
    code, err = _compare(a, b, capsys)
    assert code == 2 and err.startswith("agl: error:") and "Traceback" not in err and str(b) in err


def _sha256(path: Path) -> str:
    from agl_trainer.eval.receipt import sha256_file

    return sha256_file(path)
