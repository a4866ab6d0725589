"""Drain-free policy switches (loop.switch: keep): where each policy version starts in a completion.

A keep-mode step freezes the calls in flight at the engine, loads new weights and resumes them, so
their completions hold tokens of two (or more) versions. The trainer's resume names the new version
and, where the engine can say, how many completion tokens each frozen request had generated
(`engine_progress`, by engine request id). The sidecar keeps the last switches here; a call in
flight across one resolves its boundary when its span is built, best source first:

- the engine's word: the progress of the request whose id is the call's response id (vLLM's
  internal ids are the response id plus suffixes: `chatcmpl-X-1a2b3c4d`, `cmpl-X-0-1a2b3c4d`);
- the engine's word that it froze nothing (an empty report): the call had finished generating
  before the freeze landed (a pause takes about 100 ms to land on vLLM), so all its tokens are of
  the older version, however late its last bytes reach the sidecar;
- for a stream, the choice-0 tokens the sidecar had received when it first saw the switch (the
  sidecar resumes before the engine does, so no token of the new weights can come before the mark);
- else unknown: those tokens keep the older version (importance weights use the engine's own
  logprobs, so the update stays correct; only the staleness count is conservative), counted in
  `SwitchLog.unresolved`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

KEEP_SWITCHES = 256  # a call frozen across more switches than this resolves the older ones as unknown
# Engine progress entries kept over the whole log (about 200 bytes each): past it the oldest switches
# lose theirs (their boundaries fall back to the stream's marks, else unknown), so memory is bounded
# however many requests each switch froze. One resume may carry at most MAX_PROGRESS (routes/admin.py).
MAX_LOG_PROGRESS = 262_144
MAX_PROGRESS = 65_536
MAX_PROGRESS_ID_CHARS = 256  # an engine request id (vLLM's: about 50)


@dataclass(frozen=True, slots=True)
class Switch:
    serial: int  # 1, 2, ... in the order the switches happened
    version: int  # the policy version in force from this switch on
    progress: Mapping[str, int] | None  # engine request id -> completion tokens before the freeze; None: no word


class SwitchLog:
    """The switches of one run, in non-decreasing version order; `version` is the newest switch's (-1:
    none yet). A run that goes back to a lower version gets a new log (proxy/gate.py)."""

    def __init__(self, keep: int = KEEP_SWITCHES, unresolved: int = 0) -> None:
        self._switches: deque[Switch] = deque(maxlen=keep)
        self._progress_entries = 0  # over the switches kept
        self.serial = 0
        self.version = -1
        self.unresolved = unresolved  # boundaries neither the engine nor the stream could place

    def record(self, version: int, progress: Mapping[str, int] | None) -> Switch:
        if version < self.version:
            raise ValueError(f"a switch to version {version} after one to {self.version}: versions only rise in a log")
        self.serial += 1
        switch = Switch(self.serial, version, dict(progress) if progress is not None else None)
        if len(self._switches) == self._switches.maxlen:
            self._progress_entries -= len(self._switches[0].progress or ())
        self._switches.append(switch)
        self._progress_entries += len(switch.progress or ())
        for i, old in enumerate(self._switches):
            if self._progress_entries <= MAX_LOG_PROGRESS or old is switch:
                break
            if old.progress:  # an empty report (froze nothing) costs nothing and stays exact
                self._progress_entries -= len(old.progress)
                self._switches[i] = Switch(old.serial, old.version, None)
        self.version = version
        return switch

    def since(self, version: int) -> list[Switch]:
        """Switches to versions newer than `version`, oldest first."""
        if self.version <= version:
            return []
        return [s for s in self._switches if s.version > version]


def engine_progress(progress: Mapping[str, int] | None, response_id: str | None) -> int | None:
    """The engine's token count for the request behind `response_id`, if it reported one."""
    if not progress or not response_id:
        return None
    exact = progress.get(response_id)
    if exact is not None:
        return exact
    prefix = response_id + "-"
    matches = sorted(k for k in progress if k.startswith(prefix))
    if not matches:
        return None
    first_prompt = [k for k in matches if k.startswith(prefix + "0-")]  # completions: prompt 0's request
    return progress[(first_prompt or matches)[0]]


def version_runs(
    log: SwitchLog | None,
    entry_version: int | None,
    response_id: str | None,
    marks: Mapping[int, int] | None,
    length: int,
) -> list[int] | None:
    """Run-length pairs [start, version, ...] over a completion of `length` tokens that entered
    under `entry_version`; None when every token is the entry version's (the span says it once)."""
    if log is None or entry_version is None:
        return None
    switches = log.since(entry_version)
    if not switches:
        return None
    runs = [0, entry_version]
    for switch in switches:
        if switch.progress is not None and not switch.progress:
            continue  # the engine held no request at the freeze: this one had finished generating
        start = engine_progress(switch.progress, response_id)
        if start is None and marks:
            start = marks.get(switch.serial)
        if start is None:
            log.unresolved += 1
            continue
        if start >= length:
            continue  # every token came before the switch (the call finished while frozen)
        if start <= runs[-2]:
            runs[-1] = switch.version  # no token between the previous start and this one
        else:
            runs += [start, switch.version]
    return None if runs == [0, entry_version] else runs
