"""`agl traces import | ls | inspect` and `agl receive` argument errors, run through the real CLI."""

from __future__ import annotations

import json

import pytest
from agl_trainer.cli import main

from tests.dataplane.otlp import call_span, request, reward_span, rollout_span, to_otlp_json
from agl_testing.tiny_tokenizer import encode, special


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal; keep table cells on one line


def write_jsonl(path, requests, bad_line_at=None):
    lines = [json.dumps(to_otlp_json(message)) for message in requests]
    if bad_line_at is not None:
        lines.insert(bad_line_at, '{"resourceSpans": [{"scopeSpans": "not a list"}]}')
    path.write_text("\n".join(lines) + "\n")


def rollout(rollout_id):
    prompt = [special("<|im_start|>")] + encode("user hello") + [special("<|im_end|>")]
    generated = encode("hel") + encode("lo world") + [special("<|im_end|>")]
    retokenized = prompt + encode("hello world") + [special("<|im_end|>")] + encode(" the tool says 42")
    return [
        call_span(rollout_id, 0, prompt, generated, version=1),
        call_span(rollout_id, 1, retokenized, encode(" ok"), version=2),
        call_span(rollout_id, 2, retokenized + encode(" ok") + [7], [9], version=2),
        reward_span(rollout_id, 0.75),
        rollout_span(rollout_id),
    ]


def test_import_ls_inspect(tmp_path, capsys):
    source = tmp_path / "traces.jsonl"
    store = str(tmp_path / "store.db")
    write_jsonl(source, [request(rollout("rollout-alpha")), request(rollout("rollout-beta"))], bad_line_at=1)

    assert (
        main(["traces", "import", str(source), "--store", store]) == 1
    )  # one line is bad: exit 1, the rest in
    out = capsys.readouterr().out
    assert "10 stored" in out and "line 2: invalid OTLP JSON: Expected `array`" in out

    assert main(["traces", "import", str(source), "--store", store]) == 1
    assert "0 stored, 10 already there" in capsys.readouterr().out

    assert main(["traces", "ls", "--store", store, "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "rollout-alpha" in out and "rollout-beta" in out and "2 ready" in out

    assert main(["traces", "inspect", "rollout-al", "--store", store]) == 0
    out = capsys.readouterr().out
    assert "rollout-alpha" in out and "merge failures" in out and "retokenization" in out
    assert "heuristic" in out and "merged" in out and "reward" in out and "0.75" in out
    assert "policy versions [2]" in out  # the second sample holds calls 1 and 2, both served by version 2


def test_inspect_with_a_tokenizer_directory(tmp_path, capsys):
    from agl_testing.tiny_tokenizer import tiny_tokenizer

    tokenizer_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tokenizer_dir)
    source = tmp_path / "t.jsonl"
    store = str(tmp_path / "s.db")
    write_jsonl(source, [request(rollout("r"))])
    assert main(["traces", "import", str(source), "--store", store]) == 0
    capsys.readouterr()
    assert (
        main(["traces", "inspect", "--store", store, "--tokenizer", str(tokenizer_dir), "--max-tokens", "50"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "the tool says" in out and "tokenizer" in out
    )  # text shown; the failure classified by the tokenizer


def test_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert main(["traces", "ls", "--store", str(tmp_path / "none.db")]) == 2
    assert "no store at" in capsys.readouterr().err
    store = str(tmp_path / "s.db")
    write_jsonl(tmp_path / "x.jsonl", [request(rollout("r1")), request(rollout("r2"))])
    main(["traces", "import", str(tmp_path / "x.jsonl"), "--store", store])
    capsys.readouterr()
    assert main(["traces", "inspect", "r", "--store", store]) == 2
    assert "matches 2 rollouts" in capsys.readouterr().err
    assert main(["traces", "inspect", "zzz", "--store", store]) == 2
    assert "no rollout matches" in capsys.readouterr().err
    assert main(["traces", "import", str(tmp_path / "missing.jsonl"), "--store", store]) == 2
    assert main(["receive", "--store", store, "--listen", "nohost"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    for size in ("nan", "inf", "0"):
        assert main(["receive", "--store", store, "--listen", "127.0.0.1:0", "--max-request-mb", size]) == 2
        assert f"--max-request-mb {float(size)}: expected a size in MB" in capsys.readouterr().err


HOSTILE_IDS = {
    "esc\x1b]0;pwned\x07\x1b[2J": "esc\\x1b]0;pwned\\x07\\x1b[2J",
    "nul\x00byte": "nul\\x00byte",
    "cr\rlf\nend": "cr\\x0dlf\\x0aend",
    "bidi\u202eevil": "bidi\\u202eevil",
    "c1\x9bcsi": "c1\\x9bcsi",
    "markup[/]x[red]y": "markup[/]x[red]y",  # shown as typed, not read as rich markup
}


def test_control_characters_from_harnesses_never_reach_the_terminal_raw(tmp_path, capsys):
    """Rollout and task ids with ESC, NUL, CR/LF, C1 and bidi controls are shown as escapes in
    `agl traces ls` and `agl traces inspect` (once they reached the terminal raw)."""
    from agl_trainer.store import RolloutStore

    from tests.dataplane.ingest import ingest

    store_path = tmp_path / "s.db"
    with RolloutStore(store_path) as store:
        for index, rollout_id in enumerate(HOSTILE_IDS):
            ingest(
                store,
                [
                    call_span(rollout_id, 0, [1, 2], [3], task_id=f"task\x1b[31m{index}"),
                    reward_span(rollout_id, 1.0, name="re\x1bward"),
                    rollout_span(rollout_id, task_id=f"task\x1b[31m{index}"),
                ],
            )
    raw = "\x1b\x00\r\x07\u202e\x9b"

    assert main(["traces", "ls", "--store", str(store_path), "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    assert not set(raw) & set(out), [c for c in out if c in raw]
    for shown in HOSTILE_IDS.values():
        assert shown in out
    assert "task\\x1b[31m0" in out

    for rollout_id, shown in HOSTILE_IDS.items():
        assert main(["traces", "inspect", rollout_id, "--store", str(store_path)]) == 0
        out = capsys.readouterr().out
        assert not set(raw) & set(out)
        assert shown in out and "re\\x1bward" in out

    assert main(["traces", "inspect", "esc\x1b", "--store", str(store_path), "--attempt", "5"]) == 2
    err = capsys.readouterr().err
    assert "no rollout matches 'esc\\x1b'" in err and "\x1b" not in err
