"""The embedded engine through the `openai` SDK: vLLM's extra fields, streaming, seeds, token IDs."""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
EXTRA = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _chat(client: OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=EXTRA, **kwargs)


def test_token_ids_decode_to_the_returned_text(client: OpenAI, engine: Any) -> None:
    response = _chat(client, max_tokens=12, seed=7, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == response.usage.completion_tokens == 12
    assert engine.tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content
    prompt_ids = response.model_extra["prompt_token_ids"]
    rendered = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt_ids == engine.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(prompt_ids) == response.usage.prompt_tokens
    entries = choice.logprobs.content
    assert len(entries) == 12 and all(len(e.top_logprobs) == 3 for e in entries)
    for entry in entries:  # the sampled token's logprob can never beat the best one
        assert entry.logprob <= max(t.logprob for t in entry.top_logprobs) + 1e-6


def test_logprobs_are_the_models_raw_logprobs(client: OpenAI, engine: Any) -> None:
    import torch

    response = _chat(client, max_tokens=6, seed=3, logprobs=True, temperature=0.7)
    token_ids = response.choices[0].model_extra["token_ids"]
    prompt_ids = response.model_extra["prompt_token_ids"]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    got = torch.tensor([e.logprob for e in response.choices[0].logprobs.content])
    assert torch.allclose(got, expected, atol=1e-4)


def test_stream_concatenates_to_the_non_stream_answer(client: OpenAI) -> None:
    whole = _chat(client, max_tokens=12, seed=11, logprobs=True)
    stream = _chat(
        client, max_tokens=12, seed=11, logprobs=True, stream=True, stream_options={"include_usage": True}
    )
    text, token_ids, logprobs, finish, usage, prompt_ids = "", [], [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids")
        for choice in chunk.choices:
            text += choice.delta.content or ""
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            logprobs += [e.logprob for e in (choice.logprobs.content if choice.logprobs else [])]
            finish = choice.finish_reason or finish
    choice = whole.choices[0]
    assert text == choice.message.content
    assert token_ids == choice.model_extra["token_ids"]
    assert logprobs == [e.logprob for e in choice.logprobs.content]
    assert finish == choice.finish_reason == "length"
    assert prompt_ids == whole.model_extra["prompt_token_ids"]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_seed_reproduces_and_other_seeds_differ(client: OpenAI) -> None:
    first = [_chat(client, max_tokens=10, seed=5).choices[0].model_extra["token_ids"] for _ in range(2)]
    assert first[0] == first[1]
    others = {
        tuple(_chat(client, max_tokens=10, seed=s).choices[0].model_extra["token_ids"]) for s in range(6, 10)
    }
    assert len(others) == 4 and tuple(first[0]) not in others


def test_n2_choice_zero_is_the_n1_sample(client: OpenAI) -> None:
    single = _chat(client, max_tokens=8, seed=21)
    double = _chat(client, max_tokens=8, seed=21, n=2)
    assert [c.index for c in double.choices] == [0, 1]
    assert double.choices[0].model_extra["token_ids"] == single.choices[0].model_extra["token_ids"]
    assert double.choices[1].model_extra["token_ids"] != double.choices[0].model_extra["token_ids"]
    assert double.usage.completion_tokens == 16


def test_temperature_zero_is_greedy(client: OpenAI, engine: Any) -> None:
    import torch

    response = _chat(client, max_tokens=5, temperature=0, seed=1)
    token_ids = response.choices[0].model_extra["token_ids"]
    ids = list(response.model_extra["prompt_token_ids"])
    with torch.no_grad():
        for token in token_ids:
            assert int(engine.model(torch.tensor([ids])).logits[0, -1].argmax()) == token
            ids.append(token)


def test_top_k_one_equals_greedy(client: OpenAI) -> None:
    greedy = _chat(client, max_tokens=6, temperature=0).choices[0].model_extra["token_ids"]
    top1 = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, seed=4, extra_body={**EXTRA, "top_k": 1}
    )
    assert top1.choices[0].model_extra["token_ids"] == greedy


def test_completions_with_token_prompt_equal_text_prompt(client: OpenAI, engine: Any) -> None:
    text = "The quick brown fox"
    ids = engine.tokenizer(text)["input_ids"]
    by_text = client.completions.create(
        model="tiny", prompt=text, max_tokens=6, seed=9, logprobs=1, extra_body=EXTRA
    )
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=6, seed=9, logprobs=1, extra_body=EXTRA
    )
    assert by_text.choices[0].model_extra["token_ids"] == by_ids.choices[0].model_extra["token_ids"]
    assert by_text.choices[0].model_extra["prompt_token_ids"] == ids
    assert by_text.choices[0].logprobs.token_logprobs == by_ids.choices[0].logprobs.token_logprobs
    offsets = by_text.choices[0].logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_unknown_model_is_a_404_the_sdk_understands(client: OpenAI) -> None:
    import openai

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100_000)


def test_prompt_plus_max_tokens_over_the_context_is_cut_at_the_context(client: OpenAI, engine: Any) -> None:
    prompt = [5] * (engine.max_model_len - 4)
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=100, seed=0, extra_body={**EXTRA, "ignore_eos": True}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert len(prompt) + len(choice.model_extra["token_ids"]) == engine.max_model_len
