"""The Anthropic SDK through the sidecar's /v1/messages (Claude-style harnesses on an open model).

    with agl.rollout(task_id="t1"):
        client = anthropic_client("http://127.0.0.1:8080")
        client.messages.create(model="my-model", max_tokens=256, messages=[...])
        agl.emit_reward(1.0)

A harness that cannot be changed at all needs only ANTHROPIC_BASE_URL=http://sidecar/rollouts/ID
(agl's runners set it).
"""

from __future__ import annotations

from typing import Any

from agl import Rollout

from agl_integrations.endpoint import sidecar_endpoint


def anthropic_client(
    sidecar_url: str | None = None,
    *,
    rollout: Rollout | None = None,
    async_client: bool = False,
    **kwargs: Any,
) -> Any:
    """An `anthropic.Anthropic` (or `AsyncAnthropic`) client for the current rollout."""
    import anthropic

    endpoint = sidecar_endpoint(sidecar_url, rollout)
    headers = {**endpoint.headers, **kwargs.pop("default_headers", {})}
    cls = anthropic.AsyncAnthropic if async_client else anthropic.Anthropic
    return cls(base_url=endpoint.root_url, api_key=endpoint.api_key, default_headers=headers, **kwargs)
