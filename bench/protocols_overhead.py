"""What the Anthropic Messages and Responses fronts cost, against the chat-completions path.

    python bench/protocols_overhead.py [--quick] [--peers] [--claude-code-only]

Part 1, translation CPU per call (in-process, no network): agl's adapters against litellm's own
translation of the same call (for Responses also Codex's first request), the path litellm's proxy takes for /v1/messages and /v1/responses to
an OpenAI-compatible model (request in, litellm `ModelResponse` / `ModelResponseStream` objects,
response out). A tool-calling request with history; a vLLM-shaped tool-call response; a 40-chunk
text stream. Prints microseconds per call and litellm / agl.

Part 2, through agl-sidecar over loopback (fake vLLM and sidecar in their own processes): the same
question as chat completions direct to the engine (the reference), chat through the sidecar,
Anthropic Messages and Responses through the sidecar; and Codex CLI 0.169.0's first request
(tests/fixtures/codex-0.169.0/plain_prompt.json, 46 KB) through the sidecar, against the chat request
the sidecar makes of it sent direct and sent through the sidecar's chat path (the difference is the
translation's cost; a 38k-token prompt for the fake vLLM's byte tokenizer); streaming and not; concurrency 1 (latency) and 32 (throughput). Targets are interleaved in small blocks (the machine is shared). Prints the
latency each path adds over direct and its ratio to the chat path's.

Part 3, Claude Code's own request (tests/fixtures/claude-code-2.1.328: Claude Code 2.1.328's second
call of a Bash tool loop, captured from its traffic: a 48k-character system prompt and tool list, 12
tools one of them deferred, `system` entries, thinking, context_management, streaming): its
translation CPU against litellm's, then through the sidecar against the minimal pass-through of
bench/sidecar_overhead.py (the floor, forwarding the same request already translated to chat) and
the sidecar's own chat route, streaming, concurrency 1 and 8. The fake vLLM counts a byte as a
token, so its prompt is about 50k tokens (a real tokenizer: about 12k).

With --peers, the litellm proxy (installed under /tmp by scripts/setup_bench_peers.sh, one worker,
the model routed to the same fake vLLM as hosted_vllm) joins the same interleaved blocks: chat
completions (the client asking for token IDs, as direct) and /v1/messages, which litellm translates
to chat for an OpenAI-compatible model, the same translation agl's /v1/messages does. Prints its
added latency and agl's /v1/messages added latency / litellm's.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _load import JSON, free_port, one_call, run_block, wait_up  # bench/ is on sys.path as a script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
PY = sys.executable

FAKE = """
import sys, uvloop
sys.path.insert(0, {root!r})
from aiohttp import web
from agl_testing.fake_vllm import FakeVLLM
app = FakeVLLM().build_app()
async def traces(request):
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")
app.router.add_post("/v1/traces", traces)
web.run_app(app, host="127.0.0.1", port={port}, access_log=None, print=None, loop=uvloop.new_event_loop())
"""

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18C"}]},
    {"role": "assistant", "content": "It is 18C in Paris."},
    {"role": "user", "content": "And in Oslo?"},
]
TOOL = {
    "name": "get_weather",
    "description": "Weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ANTHROPIC_BODY = {
    "model": "tiny",
    "max_tokens": 256,
    "system": "Be brief.",
    "tools": [TOOL],
    "messages": HISTORY,
}
RESPONSES_BODY = {
    "model": "tiny",
    "instructions": "Be brief.",
    "max_output_tokens": 256,
    "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["input_schema"]}],
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"role": "assistant", "content": "It is 18C in Paris."},
        {"role": "user", "content": "And in Oslo?"},
    ],
}


def codex_body() -> dict[str, Any]:
    """The first request Codex CLI 0.169.0 sends (tests/fixtures/codex-0.169.0/plain_prompt.json): 4
    input items (17 KB of developer instructions), 9 tools (a namespace of 5 functions, web_search),
    client_metadata; streaming. Asked for at most 64 output tokens, as the other cases."""
    from agl_testing.captures import CODEX_CAPTURES

    record = json.loads((CODEX_CAPTURES / "plain_prompt.json").read_text())
    return {**record["exchanges"][0]["body"], "max_output_tokens": 64}


def per_call_us(fn: Callable[[], Any], seconds: float) -> float:
    fn()  # warm
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def translation_costs(seconds: float) -> None:
    from agl_sidecar.protocols.anthropic import MESSAGES
    from agl_sidecar.protocols.responses import ResponsesAdapter
    from litellm import ModelResponse
    from litellm.llms.anthropic.messages.adapters.streaming_iterator import AnthropicStreamWrapper
    from litellm.llms.anthropic.messages.adapters.transformation import AnthropicAdapter
    from litellm.responses.litellm_completion_transformation.transformation import (
        LiteLLMCompletionResponsesConfig,
    )
    from litellm.types.utils import ModelResponseStream

    from agl_testing.wire import stream_fixture, tool_call_response

    chat = tool_call_response("Let me check.")
    chunks = stream_fixture("chat_stream_token_ids_logprobs_usage") * 3  # ~40 chunks
    chunks = [c for c in chunks if c["choices"]] + [chunks[-1]]
    responses = ResponsesAdapter()
    adapter = AnthropicAdapter()

    def agl_messages() -> None:
        MESSAGES.to_chat_request(ANTHROPIC_BODY)
        MESSAGES.from_chat_response(chat, ANTHROPIC_BODY)

    def litellm_messages() -> None:
        adapter.translate_completion_input_params_with_tool_mapping(
            dict(ANTHROPIC_BODY), custom_llm_provider="hosted_vllm"
        )
        dict(adapter.translate_completion_output_params(ModelResponse(**copy.deepcopy(chat))))

    def agl_messages_stream() -> None:
        translator = MESSAGES.stream_translator(ANTHROPIC_BODY)
        for chunk in chunks:
            translator.feed(chunk)
        translator.finish()

    def litellm_messages_stream() -> None:
        stream = iter([ModelResponseStream(**copy.deepcopy(c)) for c in chunks])
        for _ in AnthropicStreamWrapper(completion_stream=stream, model="tiny").anthropic_sse_wrapper():
            pass

    def agl_responses() -> None:
        body = dict(RESPONSES_BODY)
        responses.to_chat_request(body)
        responses.from_chat_response(chat, body)

    def litellm_responses() -> None:
        params = {k: v for k, v in RESPONSES_BODY.items() if k not in ("model", "input")}
        LiteLLMCompletionResponsesConfig.transform_responses_api_request_to_chat_completion_request(
            model="tiny",
            input=RESPONSES_BODY["input"],
            responses_api_request=params,
            custom_llm_provider="hosted_vllm",
        )
        LiteLLMCompletionResponsesConfig.transform_chat_completion_response_to_responses_api_response(
            request_input=RESPONSES_BODY["input"],
            responses_api_request=params,
            chat_completion_response=copy.deepcopy(chat),
        ).model_dump()

    def agl_responses_stream() -> None:
        translator = responses.stream_translator(RESPONSES_BODY)
        for chunk in chunks:
            translator.feed(chunk)
        translator.finish()

    codex = codex_body()

    def agl_codex() -> None:
        body = dict(codex)
        responses.to_chat_request(body)
        responses.from_chat_response(chat, body)

    def litellm_codex() -> None:
        params = {k: v for k, v in codex.items() if k not in ("model", "input")}
        LiteLLMCompletionResponsesConfig.transform_responses_api_request_to_chat_completion_request(
            model="tiny", input=codex["input"], responses_api_request=params, custom_llm_provider="hosted_vllm"
        )
        LiteLLMCompletionResponsesConfig.transform_chat_completion_response_to_responses_api_response(
            request_input=codex["input"], responses_api_request=params, chat_completion_response=copy.deepcopy(chat)
        ).model_dump()

    print("Part 1: translation CPU per call (request + response), us")
    print(f"{'':34}{'agl':>10}{'litellm':>10}{'litellm/agl':>13}")
    pairs = [
        ("anthropic, non-stream (tool call)", agl_messages, litellm_messages),
        (f"anthropic, stream ({len(chunks)} chunks)", agl_messages_stream, litellm_messages_stream),
        ("responses, non-stream (tool call)", agl_responses, litellm_responses),
        (f"responses, stream ({len(chunks)} chunks)", agl_responses_stream, None),
        (f"responses, Codex's request ({len(json.dumps(codex)) // 1000} KB)", agl_codex, litellm_codex),
    ]
    for name, ours, theirs in pairs:
        ours_us = per_call_us(ours, seconds)
        if theirs is None:
            print(f"{name:34}{ours_us:10.0f}{'n/a':>10}{'':>13}")
            continue
        theirs_us = per_call_us(theirs, seconds)
        print(f"{name:34}{ours_us:10.0f}{theirs_us:10.0f}{theirs_us / ours_us:12.2f}x")
    print("  (litellm's Responses stream iterator needs its CustomStreamWrapper around a live call: not run)")


# --- part 2 ------------------------------------------------------------------------------------
def bodies(stream: bool, with_litellm: bool) -> dict[str, tuple[str, str, dict[str, Any]]]:
    question = [{"role": "user", "content": "What is the weather in Paris today? " * 20}]
    chat = {"model": "tiny", "messages": question, "max_tokens": 64, "stream": stream}
    direct = {**chat, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
    anthropic = {"model": "tiny", "max_tokens": 64, "messages": question, "stream": stream}
    responses = {"model": "tiny", "input": question[0]["content"], "max_output_tokens": 64, "stream": stream}
    from agl_sidecar.protocols.responses import ResponsesAdapter

    codex = {**codex_body(), "stream": stream}
    codex_chat = ResponsesAdapter().to_chat_request(dict(codex)).chat  # what the sidecar sends the engine
    codex_direct = {**codex_chat, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
    targets = {
        "direct (chat)": ("engine", "/v1/chat/completions", direct),
        "sidecar chat": ("sidecar", "/v1/chat/completions", chat),
        "sidecar anthropic": ("sidecar", "/v1/messages", anthropic),
        "sidecar responses": ("sidecar", "/v1/responses", responses),
        # Codex's request: the sidecar's translation, against its chat request sent direct
        "direct (codex chat)": ("engine", "/v1/chat/completions", codex_direct),
        "sidecar chat (codex chat)": ("sidecar", "/v1/chat/completions", codex_chat),
        "sidecar responses (codex)": ("sidecar", "/v1/responses", codex),
    }
    if with_litellm:  # litellm passes return_token_ids through on chat; Messages has no field for it
        targets["litellm chat"] = ("litellm", "/v1/chat/completions", direct)
        targets["litellm anthropic"] = ("litellm", "/v1/messages", anthropic)
    return targets


def start_servers(spool: str) -> tuple[list[subprocess.Popen], str, str]:
    """The fake vLLM (also the span sink) and agl-sidecar, each in its own process."""
    engine_port, sidecar_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    fake = subprocess.Popen([PY, "-c", FAKE.format(root=str(ROOT), port=engine_port)])
    flags = [
        "--upstream",
        engine,
        "--listen",
        f"127.0.0.1:{sidecar_port}",
        "--otlp-endpoint",
        engine,
        "--spool-dir",
        spool,
    ]
    sidecar = subprocess.Popen([PY, "-m", "agl_sidecar.cli", *flags], stdout=subprocess.DEVNULL)
    return [fake, sidecar], engine, f"http://127.0.0.1:{sidecar_port}"


async def through_sidecar(engine: str, sidecar: str, quick: bool, litellm: Any = None) -> None:
    import aiohttp

    bases = {"engine": (engine, JSON), "sidecar": (sidecar, JSON)}
    if litellm is not None:
        bases["litellm"] = (litellm.base, {**JSON, **litellm.headers})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_up(engine + "/health", session)
        await wait_up(sidecar + "/healthz", session)
        await first_translated_call(session, sidecar)
        print("\nPart 2: through agl-sidecar (fake vLLM, 64 output tokens); added = p50 - direct's p50")
        rounds, per_block = (3, 20) if quick else (8, 40)
        for stream in (False, True):
            targets = {name: (bases[where][0] + path, json.dumps(body).encode(), bases[where][1])
                       for name, (where, path, body) in bodies(stream, litellm is not None).items()}  # fmt: skip
            for name, (url, body, headers) in list(targets.items()):  # warm: agl's adapters import litellm
                try:
                    await one_call(session, url, body, stream, headers)
                except RuntimeError as e:
                    if not name.startswith("litellm"):
                        raise
                    print(f"stream={stream!s:5} {name}: NOT RUN: {str(e).split(': ', 1)[-1]}")
                    del targets[name]
            for concurrency in (1, 32):
                lat: dict[str, list[float]] = {n: [] for n in targets}
                busy: dict[str, float] = {n: 0.0 for n in targets}
                for _ in range(rounds):
                    for name, (url, body, headers) in targets.items():
                        calls = per_block * (4 if concurrency > 1 else 1)
                        got, took = await run_block(session, url, body, stream, calls, concurrency, headers)
                        lat[name] += got
                        busy[name] += took
                report(stream, concurrency, lat, busy)


async def first_translated_call(session: Any, sidecar: str) -> None:
    """A fresh sidecar imports litellm (seconds) for its first translated call, in a worker thread:
    chat calls sent meanwhile are answered as usual, not held until the import is done."""
    question = [{"role": "user", "content": "hi"}]
    messages = json.dumps({"model": "tiny", "max_tokens": 8, "messages": question}).encode()
    chat = json.dumps({"model": "tiny", "max_tokens": 8, "messages": question}).encode()
    first = asyncio.ensure_future(one_call(session, sidecar + "/v1/messages", messages, False))
    await asyncio.sleep(0.3)  # the import is under way
    chats: list[float] = []
    while not first.done() and len(chats) < 20:
        chats.append(await one_call(session, sidecar + "/v1/chat/completions", chat, False))
    took = await first
    print(f"\nPart 1b: the first /v1/messages call (imports litellm) took {took * 1e3:.0f} ms; "
          f"{len(chats)} chat calls meanwhile, slowest {max(chats, default=0) * 1e3:.1f} ms "
          f"= {max(chats, default=0) / took:.3f}x the translated call's (held by the import: ~1x)")


def claude_code_body() -> dict[str, Any]:
    """Claude Code 2.1.328's second call of a tool loop, as captured (tests/fixtures)."""
    import lzma

    with lzma.open(ROOT / "tests" / "fixtures" / "claude-code-2.1.328" / "tool_loop.jsonl.xz") as f:
        return json.loads(f.read().splitlines()[1])["body"]


def claude_code_translation(seconds: float) -> None:
    from agl_sidecar.protocols.anthropic import MESSAGES
    from litellm.llms.anthropic.messages.adapters.transformation import AnthropicAdapter

    body = claude_code_body()
    adapter = AnthropicAdapter()
    ours = per_call_us(lambda: MESSAGES.to_chat_request(body), seconds)
    theirs = per_call_us(lambda: adapter.translate_completion_input_params_with_tool_mapping(
        copy.deepcopy(body), custom_llm_provider="hosted_vllm"), seconds)  # fmt: skip
    print("\nPart 3: Claude Code 2.1.328's request (captured; 48k characters, 12 tools, streaming)")
    print(f"  request translation CPU: agl {ours:.0f} us, litellm {theirs:.0f} us ({theirs / ours:.2f}x agl's)")


async def claude_code_through_sidecar(engine: str, sidecar: str, floor: str, quick: bool) -> None:
    import aiohttp

    from agl_sidecar.protocols.anthropic import MESSAGES

    body = claude_code_body()
    chat = MESSAGES.to_chat_request(body).chat
    direct = {**chat, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
    targets = {
        "direct (chat)": (engine + "/v1/chat/completions", json.dumps(direct).encode()),
        "floor (chat)": (floor + "/v1/chat/completions", json.dumps(chat).encode()),
        "sidecar chat": (sidecar + "/v1/chat/completions", json.dumps(chat).encode()),
        "sidecar anthropic": (sidecar + "/v1/messages", json.dumps(body).encode()),
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in (engine + "/health", sidecar + "/healthz", floor + "/v1/chat/completions"):
            await wait_up(url, session)
        for url, data in targets.values():  # warm (the first translated call imports litellm)
            await one_call(session, url, data, True)
        rounds, per_block = (3, 10) if quick else (8, 25)
        for concurrency in (1, 8):
            lat: dict[str, list[float]] = {n: [] for n in targets}
            busy: dict[str, float] = {n: 0.0 for n in targets}
            for _ in range(rounds):
                for name, (url, data) in targets.items():
                    got, took = await run_block(session, url, data, True, per_block * (2 if concurrency > 1 else 1), concurrency)
                    lat[name] += got
                    busy[name] += took
            base = statistics.median(lat["direct (chat)"])
            added = {name: statistics.median(v) - base for name, v in lat.items()}
            print(f"  stream=True concurrency={concurrency}")
            for name, values in lat.items():
                line = f"    {name:18} p50 {statistics.median(values) * 1e3:7.2f} ms  {len(values) / busy[name]:6.0f} req/s"
                if name != "direct (chat)":
                    line += f"  added {added[name] * 1e3:6.2f} ms"
                    if added["floor (chat)"] > 0 and name != "floor (chat)":
                        line += f"  ({added[name] / added['floor (chat)']:.2f}x the floor's)"
                print(line)


# Each translated path is compared with its own proxy's chat path: what the translation adds.
CHAT_OF = {"sidecar anthropic": "sidecar chat", "sidecar responses": "sidecar chat",
           "sidecar responses (codex)": "sidecar chat (codex chat)", "litellm anthropic": "litellm chat"}  # fmt: skip


# The direct call each target is measured against (the same question, asked of the engine itself).
DIRECT_OF = {"sidecar responses (codex)": "direct (codex chat)", "sidecar chat (codex chat)": "direct (codex chat)"}
DIRECT = ("direct (chat)", "direct (codex chat)")


def report(stream: bool, concurrency: int, lat: dict[str, list[float]], busy: dict[str, float]) -> None:
    added = {name: statistics.median(values) - statistics.median(lat[DIRECT_OF.get(name, "direct (chat)")])
             for name, values in lat.items()}  # fmt: skip
    print(f"stream={stream!s:5} concurrency={concurrency}")
    for name, values in lat.items():
        p50 = statistics.median(values)
        p99 = sorted(values)[int(0.99 * (len(values) - 1))]
        line = f"  {name:26} p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms  {len(values) / busy[name]:7.0f} req/s"
        if name not in DIRECT:
            line += f"  added {added[name] * 1e3:6.2f} ms"
            chat = CHAT_OF.get(name)
            if chat in added and added[chat] > 0:
                line += f"  ({added[name] / added[chat]:.2f}x {chat}'s)"
        print(line)
    for ours, theirs in (("sidecar anthropic", "litellm anthropic"), ("sidecar chat", "litellm chat")):
        if ours in added and theirs in added and added[theirs] > 0:
            print(
                f"  => {ours} added p50 / {theirs}'s: {added[ours] / added[theirs]:.2f}x; "
                f"throughput {len(lat[ours]) / busy[ours] / (len(lat[theirs]) / busy[theirs]):.2f}x theirs"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls (under a minute)")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also measure the litellm proxy's /v1/messages (installs it under /tmp with "
        "scripts/setup_bench_peers.sh on first use)",
    )
    parser.add_argument("--claude-code-only", action="store_true", help="only part 3 (Claude Code's request)")
    args = parser.parse_args()
    if not args.claude_code_only:
        translation_costs(0.5 if args.quick else 2.0)
    claude_code_translation(0.5 if args.quick else 2.0)
    with (
        tempfile.TemporaryDirectory() as spool,
        tempfile.TemporaryDirectory(prefix="agl-bench-peers-") as peer_dir,
    ):
        procs, engine, sidecar = start_servers(spool)
        litellm = None
        try:
            if args.peers:
                import _peers

                print("\npeers:")
                _peers.setup(skip_agentlightning=True)  # its gateway serves chat completions only
                try:
                    litellm = _peers.start_litellm(engine, "tiny", Path(peer_dir))
                except _peers.PeerUnavailable as e:
                    print(f"  litellm: NOT RUN: {e}")
                print(
                    "  Agent Lightning: not run here (its 1.0.x gateway proxies chat/completions and "
                    "completions only, no /v1/messages)"
                )
            if not args.claude_code_only:
                asyncio.run(through_sidecar(engine, sidecar, args.quick, litellm))
            from sidecar_overhead import FLOOR

            floor_port = free_port()
            procs.append(subprocess.Popen([PY, "-c", FLOOR.format(upstream=engine, port=floor_port)]))
            asyncio.run(claude_code_through_sidecar(engine, sidecar, f"http://127.0.0.1:{floor_port}", args.quick))
        finally:
            if litellm is not None:
                litellm.stop()
            for proc in reversed(procs):  # the sidecar first: it flushes spans to the fake's sink
                proc.terminate()
                proc.wait(10)


if __name__ == "__main__":
    main()
