"""Where each policy version starts in a completion generated across drain-free switches."""

from __future__ import annotations

from agl_sidecar.calls.switches import SwitchLog, engine_progress, version_runs


def test_the_engines_word_places_each_switch() -> None:
    log = SwitchLog()
    log.record(4, {"chatcmpl-a-1f2e3d4c": 10, "chatcmpl-b-99887766": 3})
    log.record(5, {"chatcmpl-a-1f2e3d4c": 25})
    assert version_runs(log, 3, "chatcmpl-a", None, 40) == [0, 3, 10, 4, 25, 5]  # two switches inside
    assert version_runs(log, 4, "chatcmpl-a", None, 40) == [0, 4, 25, 5]  # entered after the first
    assert version_runs(log, 5, "chatcmpl-a", None, 40) is None  # entered after both: one version
    assert version_runs(log, 3, "chatcmpl-b", None, 3) is None  # finished while frozen: all of v3
    assert log.unresolved == 1  # b's count for the second switch is unknown: its tokens stay older


def test_a_request_frozen_before_its_first_token_is_all_new() -> None:
    log = SwitchLog()
    log.record(1, {"cmpl-x-0-abcdef12": 0})
    assert version_runs(log, 0, "cmpl-x", None, 7) == [0, 1]


def test_a_stream_without_the_engines_word_uses_its_mark() -> None:
    log = SwitchLog()
    switch = log.record(2, None)
    assert version_runs(log, 1, "chatcmpl-s", {switch.serial: 12}, 30) == [0, 1, 12, 2]
    assert version_runs(log, 1, "chatcmpl-u", None, 30) is None and log.unresolved == 1


def test_an_engine_that_froze_nothing_leaves_every_token_older() -> None:
    """A call that finished at the engine before the freeze landed, its last bytes still on the way:
    the stream's mark would date its tail to the new version; the engine's empty report says none is."""
    log = SwitchLog()
    switch = log.record(2, {})
    assert version_runs(log, 1, "chatcmpl-late", {switch.serial: 12}, 30) is None and log.unresolved == 0
    log.record(3, None)  # no word from the engine: the mark of that switch counts
    assert version_runs(log, 1, "chatcmpl-late", {switch.serial + 1: 20}, 30) == [0, 1, 20, 3]


def test_engine_ids_match_the_response_id_and_prefer_prompt_zero() -> None:
    progress = {"cmpl-q-1-aaaaaaaa": 9, "cmpl-q-0-bbbbbbbb": 4, "chatcmpl-q2": 7}
    assert engine_progress(progress, "cmpl-q") == 4  # completions: prompt 0's request
    assert engine_progress(progress, "chatcmpl-q2") == 7  # the embedded engine's exact ids
    assert engine_progress(progress, "chatcmpl-q") is None  # a prefix of another id is not a match
    assert engine_progress(None, "cmpl-q") is None and engine_progress(progress, None) is None
