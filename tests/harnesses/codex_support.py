"""Running the real Codex CLI (testing/clis, `make clis`) headless against agl-sidecar.

- `CodexHome`: a scratch HOME whose ~/.codex/config.toml points Codex at the sidecar, either as a
  custom provider (`wire_api = "responses"`: streaming HTTP, Codex compacts locally) or as Codex's
  own OpenAI provider moved there with `openai_base_url` (the Responses WebSocket, and remote
  compaction with a `compaction_trigger` item), each in its own work directory.
- `codex_tokenizer()`: a byte-level BPE trained in-process on the prompt Codex 0.169.0 sends (its
  captured first request, tests/fixtures/codex-0.169.0, rendered by the test template), with merges
  across words within a line (`whole_lines`) and a large vocabulary: Codex's 38 KB of instructions
  and tools are about 1,100 tokens instead of 8,000, which keeps a tiny model's forward and a
  training step on them tractable on two cores.
- `captured(scenario)`: a capture with the trimmed parts restored (capture.py there).
- `run_rollout(...)`: one Codex run through agl-sidecar (spans into the real receiver and store) to a
  scripted engine (agl_testing.template_engine), ended with a reward and assembled.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from agl_testing.captures import CODEX_CAPTURES
from agl_testing.clis import Cli
from agl_testing.template_engine import REASONING_TOOLS_TEMPLATE, Script, TemplateEngine
from agl_trainer.assembly import Assembly
from agl_trainer.store.records import CallRow
from tests.support.pipeline import pipeline

CAPTURES = CODEX_CAPTURES
SAME = "<as in plain_prompt.json>"
_WEBSOCKET_LOG = "codex_api::endpoint::responses_websocket"
CUSTOM = "custom"  # a custom provider: streaming HTTP POST /v1/responses
CUSTOM_WS = "custom-websocket"  # a custom provider with `supports_websockets = true`
OPENAI = "openai"  # Codex's own OpenAI provider at the sidecar: the Responses WebSocket


@functools.cache
def _plain() -> dict[str, Any]:
    return json.loads((CAPTURES / "plain_prompt.json").read_text())


def captured(scenario: str) -> dict[str, Any]:
    """The capture of `scenario`, each request whole again (Codex's instructions and tools back)."""
    record = json.loads((CAPTURES / f"{scenario}.json").read_text())
    plain = _plain()["exchanges"][0]["body"]
    instructions = plain["input"][0]["content"][0]["text"]

    def restore(body: dict[str, Any]) -> None:
        if body.get("tools") == SAME:
            body["tools"] = plain["tools"]
        for item in body.get("input") or ():
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("text") == SAME:
                    part["text"] = instructions

    for exchange in record["exchanges"]:
        for body in [exchange.get("body") or {}, *exchange.get("messages", ())]:
            restore(body)
    return record


@functools.cache
def codex_tokenizer() -> Any:
    """See the module doc; its chat template is the test engine's (reasoning, tools, tool calls)."""
    from agl_sidecar.protocols.responses import ResponsesAdapter
    from agl_trainer.models.tiny import build_bpe_tokenizer

    chat = ResponsesAdapter().to_chat_request(_plain()["exchanges"][0]["body"]).chat
    render = build_bpe_tokenizer(["x"], vocab_size=300)
    render.chat_template = REASONING_TOOLS_TEMPLATE
    prompt = render.apply_chat_template(chat["messages"], tools=chat["tools"], add_generation_prompt=True, tokenize=False)
    tokenizer = build_bpe_tokenizer([prompt], vocab_size=16384, whole_lines=True)
    tokenizer.chat_template = REASONING_TOOLS_TEMPLATE
    return tokenizer


@dataclass
class CodexRun:
    returncode: int
    stdout: str
    stderr: str

    @property
    def websocket(self) -> bool:
        """Whether Codex spoke to the sidecar over the Responses WebSocket."""
        return "successfully connected to Responses WebSocket status=101" in self.stderr

    @property
    def session_id(self) -> str:
        """The main thread's id, as Codex prints it (`session id: ...`)."""
        for line in self.stderr.splitlines():
            if line.startswith("session id: "):
                return line.removeprefix("session id: ").strip()
        raise AssertionError(f"codex printed no session id:\n{self.stderr[-2000:]}")


class CodexHome:
    """A HOME for one Codex run at `base_url` (the sidecar's, rollout prefix included, ending in /v1)."""

    def __init__(self, root: Path, base_url: str, provider: str = CUSTOM, settings: str = "") -> None:
        self.home, self.work = root / "home", root / "work"
        (self.home / ".codex").mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        if provider in (CUSTOM, CUSTOM_WS):
            toml = (f'model = "tiny"\nmodel_provider = "agl"\n{settings}\n\n[model_providers.agl]\nname = "agl"\n'
                    f'base_url = "{base_url}"\nwire_api = "responses"\nenv_key = "AGL_KEY"\n')  # fmt: skip
            if provider == CUSTOM_WS:
                toml += "supports_websockets = true\n"
        else:
            toml = f'model = "tiny"\nopenai_base_url = "{base_url}"\n{settings}\n'
        (self.home / ".codex" / "config.toml").write_text(toml)

    def run(self, cli: Cli, prompt: str, timeout_s: float = 120) -> CodexRun:
        # RUST_LOG: Codex says when it opens the Responses WebSocket (`websocket` below)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "AGL_KEY": "unused",
               "CODEX_API_KEY": "unused", "NO_COLOR": "1", "RUST_LOG": f"{_WEBSOCKET_LOG}=info"}  # fmt: skip
        done = subprocess.run(
            [str(cli.path), "exec", "--skip-git-repo-check", prompt],
            cwd=self.work, env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        return CodexRun(done.returncode, done.stdout, done.stderr)


def last_user_text(request: dict[str, Any]) -> str:
    """The text of the last user message of a chat request the engine received."""
    for message in reversed(request["messages"]):
        if message["role"] == "user":
            content = message["content"]
            return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return ""


def tool_results(request: dict[str, Any]) -> list[str]:
    return [m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])
            for m in request["messages"] if m["role"] == "tool"]  # fmt: skip


@dataclass
class Rollout:
    """One Codex run through the sidecar to a scripted engine, as the trainer's store has it."""

    run: CodexRun
    engine: TemplateEngine
    calls: list[CallRow]  # in call order
    assembled: Assembly
    statuses: dict[str, int]  # the sidecar's answers to model calls: '{api="...",status="..."}' -> count
    provider: str


def run_rollout(tmp_path: Path, cli: Cli, script: Script, prompt: str, rollout: str, provider: str = CUSTOM,
                settings: str = "", reward: float = 1.0, task: str = "codex", scorer: str | None = None) -> Rollout:  # fmt: skip
    """`prompt` run by Codex through a sidecar (spans into a real receiver and store) to a
    TemplateEngine answering from `script`, then ended with `reward` and assembled."""
    from agl_trainer.assembly import AssemblyConfig, assemble

    with (
        TemplateEngine(codex_tokenizer(), script, scorer=scorer) as engine,
        pipeline(tmp_path / rollout, engine.base_url) as piped,
    ):
        home = CodexHome(tmp_path / rollout / "codex", f"{piped.sidecar_url}/rollouts/{rollout}/v1", provider, settings)
        run = home.run(cli, prompt)
        statuses = {}
        for line in httpx.get(piped.sidecar_url + "/metrics").text.splitlines():
            if line.startswith("agl_sidecar_requests_total{"):
                labels, _, count = line.rpartition(" ")
                statuses[labels.removeprefix("agl_sidecar_requests_total")] = int(float(count))
        store = piped.finish(rollout, reward, task_id=task)
        calls = sorted(store.load(rollout).calls, key=lambda c: c.call_seq)
        assembled = assemble(store, store.ready_rollouts(), AssemblyConfig())
    return Rollout(run, engine, calls, assembled, statuses, provider)
