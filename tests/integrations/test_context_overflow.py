"""agl_integrations.mini_swe_agent.context_overflow: which model-call errors mean the conversation
outgrew the model's context (the agent's own ending, graded) and which stay failed calls. Built as
each client raises them: the OpenAI SDK's BadRequestError from the server's 400 body, litellm's
exceptions as its mapping makes them."""

from __future__ import annotations

import httpx
import openai
import pytest

from agl_integrations.mini_swe_agent import context_overflow

VLLM = "This model's maximum context length is 2048 tokens. However, your prompt contains 2054 input tokens, which leaves no room for output tokens."


def bad_request(body: dict) -> openai.BadRequestError:
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    response = httpx.Response(400, json=body, request=request)
    return openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1/v1")._make_status_error_from_response(response)


@pytest.mark.parametrize(
    ("body", "overflow"),
    [
        ({"error": {"message": VLLM, "type": "BadRequestError", "param": "input_tokens", "code": 400}}, True),
        ({"error": {"message": "Input is too long.", "type": "invalid_request_error", "code": "context_length_exceeded"}}, True),
        ({"error": {"message": "prompt is too long: 210000 tokens > 200000 maximum", "type": "invalid_request_error"}}, True),
        ({"error": {"message": "max_tokens=1000 cannot be greater than max_model_len=512.", "param": "max_tokens", "code": 400}}, False),
        ({"error": {"message": "Field required: body.messages", "type": "Bad Request", "code": 400}}, False),
    ],
)
def test_the_openai_sdks_400s(body: dict, overflow: bool) -> None:
    error = bad_request(body)
    assert isinstance(error, openai.BadRequestError) and context_overflow(error) is overflow


def test_other_errors_are_not_overflows() -> None:
    assert not context_overflow(ValueError(VLLM))  # the words alone, not from a model call
    assert not context_overflow(openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:1")))


def test_litellms_mapped_errors() -> None:
    import litellm

    window = litellm.exceptions.ContextWindowExceededError(message=VLLM, model="tiny", llm_provider="hosted_vllm")
    other = litellm.exceptions.BadRequestError(message="Field required", model="tiny", llm_provider="hosted_vllm")
    assert context_overflow(window) and not context_overflow(other)
