"""`agl traces serve` (a real process), `agl traces ls`'s default limit, `agl traces inspect --model`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from agl_trainer.cli import main
from agl_trainer.store import RolloutStore

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, rollout_span
from tests.viewer.stores import BROKEN_ID, MERGED_ID


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def test_serve_prints_its_address_serves_the_store_and_stops_on_ctrl_c(built):
    store, tokenizer = built
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from agl_trainer.cli import main; sys.exit(main())", "traces", "serve", "--store", str(store), "--model", str(tokenizer),
         "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        found = re.findall(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert len(found) == 1, line
        assert f"tokens decoded with {tokenizer} (--model)" in line
        url = found[0]
        with urllib.request.urlopen(url + "api/rollout?id=" + MERGED_ID, timeout=60) as response:
            body = json.loads(response.read())
        assert body["decoded"] is True and "the answer is 42" in "".join(body["samples"][0]["text"])
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and "Traceback" not in err


def test_serve_errors_are_messages(tmp_path, capsys):
    assert main(["traces", "serve", "--store", str(tmp_path / "none.db")]) == 2
    assert "no store at" in capsys.readouterr().err
    RolloutStore(tmp_path / "s.db").close()
    assert main(["traces", "serve", "--store", str(tmp_path / "s.db"), "--listen", "localhost"]) == 2
    assert "listen address must be HOST:PORT" in capsys.readouterr().err
    assert main(["traces", "serve", "--store", str(tmp_path / "s.db"), "--listen", "256.1.1.1:1"]) == 2
    assert "off loopback, without a token" in capsys.readouterr().err
    assert main(["traces", "serve", "--store", str(tmp_path / "s.db"), "--listen", "256.1.1.1:1", "--no-token"]) == 2
    assert "cannot listen on 256.1.1.1:1" in capsys.readouterr().err
    assert main(["traces", "serve", "--store", str(tmp_path / "s.db"), "--model", str(tmp_path / "no-model")]) == 2
    assert "--model: cannot load a tokenizer from" in capsys.readouterr().err


def test_ls_shows_the_newest_50_by_default_and_every_one_with_all(tmp_path, capsys):
    path = tmp_path / "s.db"
    with RolloutStore(path, grace_s=0.0) as store:
        for index in range(60):
            ingest(store, [call_span(f"r{index:03d}", 0, [1, 2], [3]), rollout_span(f"r{index:03d}")])
            store.refresh_completion()  # completion order = id order
    assert main(["traces", "ls", "--store", str(path), "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "50 of 60 rollouts" in out and "r010" in out and "r059" in out and "r009" not in out
    assert out.index("r010") < out.index("r059")  # still oldest first
    assert main(["traces", "ls", "--store", str(path), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 of 60" in out and "r057" in out and "r056" not in out
    assert main(["traces", "ls", "--store", str(path), "--all"]) == 0
    out = capsys.readouterr().out
    assert "60 of 60" in out and "r000" in out
    assert main(["traces", "ls", "--store", str(path), "--limit", "0"]) == 2
    assert "--limit must be 1 or more" in capsys.readouterr().err


def test_inspect_decodes_tokens_with_a_model(built, capsys):
    store, tokenizer = built
    assert main(["traces", "inspect", BROKEN_ID, "--store", str(store), "--model", str(tokenizer)]) == 0
    out = capsys.readouterr().out
    assert "hello world" in out and "retokenization" in out and "tokenizer" in out


def test_the_store_path_is_never_created_by_serve(tmp_path):
    missing = tmp_path / "sub" / "none.db"
    assert main(["traces", "serve", "--store", str(missing)]) == 2
    assert not missing.exists() and not missing.parent.exists()
