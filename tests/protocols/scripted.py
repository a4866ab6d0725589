"""A sidecar in front of the scripted engine (tests/harnesses/support.py), with its spans in an OTLP
sink: for protocol tests that need the engine's exact token IDs across calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar

from tests.harnesses.support import Script, ScriptedEngine
from tests.support.otlp_sink import OTLPSink, ReceivedSpan


def small_agent_tokenizer() -> Any:
    """A byte-level BPE on the built-in corpus with the agent chat template (milliseconds)."""
    from agl_trainer.models.tiny import AGENT_CHAT_TEMPLATE, build_bpe_tokenizer

    return build_bpe_tokenizer(None, 384, AGENT_CHAT_TEMPLATE)


@dataclass
class Scripted:
    engine: ScriptedEngine
    url: str
    sink: OTLPSink

    def spans(self, rollout: str, count: int) -> list[ReceivedSpan]:
        """The rollout's `count` call spans, in call order."""
        mine = lambda spans: [s for s in spans if s.attributes.get("agl.rollout.id") == rollout]  # noqa: E731
        found = mine(self.sink.wait_for(lambda spans: len(mine(spans)) >= count))
        return sorted(found, key=lambda s: s.attributes["agl.call.seq"])


@contextlib.contextmanager
def scripted_sidecar(tokenizer: Any, script: Script, tmp_path: Path) -> Iterator[Scripted]:
    with ScriptedEngine(tokenizer, script) as engine, OTLPSink() as sink:
        config = SidecarConfig(
            upstream=[engine.base_url], listen="127.0.0.1:0", spool_dir=str(tmp_path / "spool"),
            otlp_endpoint=sink.endpoint, export_interval_s=0.05,
        )  # fmt: skip
        with BackgroundSidecar(config) as sidecar:
            yield Scripted(engine, sidecar.url, sink)
