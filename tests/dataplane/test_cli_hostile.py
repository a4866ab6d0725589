"""`agl traces` and `agl receive` given a store path that is not a file SQLite can open: a message
naming the path, exit status 2, never a traceback."""

from __future__ import annotations

import pytest
from agl_trainer.cli import main


@pytest.mark.parametrize("command", [["traces", "ls"], ["traces", "inspect", "r1"], ["receive", "--listen", "127.0.0.1:0"]])
@pytest.mark.parametrize("kind", ["folder", "under_a_file"])
def test_a_store_path_that_cannot_be_opened_is_named(tmp_path, capsys, command, kind):
    # Before: sqlite3.OperationalError ("unable to open database file") or FileExistsError escaped.
    if kind == "folder":
        store = tmp_path / "rollouts.db"
        store.mkdir()
    else:
        (tmp_path / "a-file").write_text("x")
        store = tmp_path / "a-file" / "rollouts.db"
    args = [*command, "--store", str(store)]
    if kind == "under_a_file" and command[0] == "traces":
        return  # `agl traces` refuses a missing store before opening it (covered by test_cli.py)
    assert main(args) == 2  # a usage error, as every other `agl: error:`
    err = capsys.readouterr().err
    assert f"{store} cannot be opened as a rollout store" in err and "Traceback" not in err


def test_a_train_config_that_is_not_utf8_is_named(tmp_path, capsys):
    # Before: UnicodeDecodeError escaped the config reader: `agl train` printed a traceback.
    path = tmp_path / "train.yaml"
    path.write_bytes(b"model: tiny\n\xff\xfe\n")
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"config file {path} is not UTF-8 text" in err and "Traceback" not in err
