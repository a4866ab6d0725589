"""The scripted engine: vLLM 0.32's wire format (the keys and token fields the sidecar reads, as in the
real captures), answers from the script in order, completions that the chat template renders back
token for token, streams whose chunks add up to the same tokens, /tokenize counting the same prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from agl_testing.captures import VLLM_CAPTURES
from agl_trainer.harness_check import chatml
from agl_trainer.harness_check.engine import ScriptedEngine, logprob
from agl_trainer.harness_check.script import DEFAULT_ANSWER, Script, ToolCall, Turn

TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object", "properties": {}}}}]
QUESTION = [{"role": "system", "content": "Be useful."}, {"role": "user", "content": "Say hé."}]


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    turns = [
        Turn(reasoning="The user wants the folder.", content="Let me look.", tool_calls=[ToolCall("Bash", {"command": "ls -a"})]),
        Turn(content="Two files: é.txt and b.txt."),
    ]  # fmt: skip
    with ScriptedEngine(Script(turns)) as running:
        yield running


def post(engine: ScriptedEngine, path: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=30)


def test_a_chat_answer_has_vllms_keys_token_ids_and_a_logprob_per_token(engine):
    body = {"model": "claude-anything", "messages": QUESTION, "tools": TOOLS, "return_token_ids": True, "logprobs": True}
    answer = post(engine, "/v1/chat/completions", body).json()
    captured = json.loads((VLLM_CAPTURES / "chat_nonstream_token_ids_logprobs.json").read_text())
    assert list(answer) == list(captured)  # vLLM's keys, in its order
    assert list(answer["choices"][0]) == list(captured["choices"][0])
    [choice] = answer["choices"]
    assert answer["model"] == "claude-anything"  # any model name is served
    assert answer["prompt_token_ids"] == chatml.render(QUESTION, TOOLS)
    text = chatml.TOKENIZER.decode(choice["token_ids"])
    assert text == (
        '<think>\nThe user wants the folder.\n</think>\n\nLet me look.\n'
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -a"}}\n</tool_call><|im_end|>'
    )
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (message["content"], message["reasoning"]) == ("Let me look.", "The user wants the folder.")
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "Bash", "arguments": '{"command": "ls -a"}'} and call["type"] == "function"
    values = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(values) == len(choice["token_ids"]) and all(-2.5 < v < 0 for v in values)
    assert values == [logprob(t, i) for i, t in enumerate(choice["token_ids"])]
    assert answer["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_the_answer_sent_back_extends_the_prompt_token_for_token_and_the_script_goes_on(engine):
    """What makes a harness's calls merge: the template renders the engine's answer exactly as it
    was generated, whatever spacing the harness gives the tool call's arguments."""
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="x")
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, extra_body={"return_token_ids": True})
    prompt, completion = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    message = first.choices[0].message
    sent_back = message.model_dump(exclude_none=True)
    sent_back["reasoning"] = message.model_extra["reasoning"]
    sent_back["tool_calls"][0]["function"]["arguments"] = '{"command":"ls -a"}'  # spelled another way
    history = [*QUESTION, sent_back, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a b"}]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, extra_body={"return_token_ids": True})
    assert second.model_extra["prompt_token_ids"][: len(prompt) + len(completion)] == prompt + completion
    assert second.choices[0].message.content == "Two files: é.txt and b.txt."
    third = client.chat.completions.create(model="m", messages=QUESTION)
    assert third.choices[0].message.content == DEFAULT_ANSWER  # the script is used up
    assert engine.answered == [0, 1, None]


def test_a_stream_adds_up_to_the_same_tokens_text_and_tool_call(engine):
    body = {"model": "m", "messages": QUESTION, "stream": True, "return_token_ids": True, "logprobs": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == chatml.render(QUESTION) and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    ids, logprobs, content, reasoning, arguments, names = [], [], "", "", "", []
    for chunk in chunks[1:-1]:
        [choice] = chunk["choices"]
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        ids += choice["token_ids"]
        logprobs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        for call in delta.get("tool_calls") or []:
            names += [call["function"]["name"]] if "name" in call["function"] else []
            arguments += call["function"].get("arguments", "")
    whole = post(engine, "/v1/chat/completions", {**body, "stream": False}).json()  # the script's next turn
    assert ids[-1] == chatml.IM_END and chatml.TOKENIZER.decode(ids).startswith("<think>\nThe user wants the folder.")
    assert len(ids) > len(whole["choices"][0]["token_ids"])  # turn 0 (a tool call) is longer than turn 1
    assert (content, reasoning, names, arguments) == ("Let me look.", "The user wants the folder.", ["Bash"], '{"command": "ls -a"}')
    assert logprobs == [logprob(t, i) for i, t in enumerate(ids)]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids) and chunks[-1]["choices"] == []


def test_a_character_split_over_tokens_streams_whole(engine):
    post(engine, "/v1/chat/completions", {"model": "m", "messages": QUESTION})  # turn 0 used
    body = {"model": "m", "messages": QUESTION, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks[1:]]
    assert "".join(p or "" for p in pieces) == "Two files: é.txt and b.txt."
    assert "é" in pieces and "" in pieces  # é is two bytes: its first token shows nothing, its second é


def test_max_tokens_cuts_the_answer_to_text(engine):
    answer = post(engine, "/v1/chat/completions", {"model": "m", "messages": QUESTION, "max_tokens": 5,
                                                    "return_token_ids": True}).json()  # fmt: skip
    [choice] = answer["choices"]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "<thin" and choice["message"]["tool_calls"] == []


def test_tokenize_counts_the_prompt_the_chat_call_sees(engine):
    counted = post(engine, "/tokenize", {"model": "m", "messages": QUESTION, "tools": TOOLS}).json()
    assert counted["tokens"] == chatml.render(QUESTION, TOOLS) and counted["count"] == len(counted["tokens"])
    assert post(engine, "/tokenize", {"prompt": "hé"}).json()["count"] == 3
    assert post(engine, "/detokenize", {"tokens": chatml.encode("hé")}).json() == {"prompt": "hé"}


def test_completions_answer_with_the_turns_text_and_prompt_ids(engine):
    answer = post(engine, "/v1/completions", {"model": "m", "prompt": "Q:", "max_tokens": 500, "return_token_ids": True,
                                              "logprobs": 0}).json()  # fmt: skip
    [choice] = answer["choices"]
    assert choice["prompt_token_ids"] == chatml.encode("Q:")
    assert choice["text"].startswith("<think>\nThe user wants the folder.") and choice["token_ids"][-1] == chatml.IM_END
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    with httpx.stream("POST", engine.url + "/v1/completions", json={"model": "m", "prompt": "Q:", "stream": True,
                                                                     "return_token_ids": True}, timeout=30) as reply:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == chatml.encode("Q:")
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert chatml.TOKENIZER.decode(streamed, skip_special_tokens=True) == "".join(c["choices"][0]["text"] for c in chunks)


def test_a_malformed_request_gets_vllms_400_naming_the_field(engine):
    reply = post(engine, "/v1/chat/completions", {"model": "m", "messages": "hi"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "body.messages" and error["code"] == 400
    assert engine.answered == []  # a refused request takes no turn
    assert httpx.get(engine.url + "/health").status_code == 200
    assert httpx.get(engine.url + "/v1/models").json()["data"][0]["max_model_len"] > 100_000
