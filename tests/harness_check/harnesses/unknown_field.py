"""A tiny harness speaking Anthropic Messages (plain HTTP) that adds a field the API does not define."""

import os

import httpx

reply = httpx.post(
    os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
    headers={"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"},
    json={
        "model": "tiny",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Hi."}],
        "agl_check_unknown_field": {"added": "by a newer harness"},
    },
    timeout=120,
)
print(reply.status_code, reply.text[:300])
reply.raise_for_status()
