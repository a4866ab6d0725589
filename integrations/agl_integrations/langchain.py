"""LangChain and LangGraph through the sidecar: a `ChatOpenAI` pointed at it.

with agl.rollout(task_id="t1"):
    agent = create_react_agent(chat_model("my-model", "http://127.0.0.1:8080"), tools)
    agent.invoke({"messages": [("user", task)]})
    agl.emit_reward(1.0)
"""

from __future__ import annotations

from typing import Any

from agl import Rollout

from agl_integrations.endpoint import sidecar_endpoint


def chat_model(
    model: str, sidecar_url: str | None = None, *, rollout: Rollout | None = None, **kwargs: Any
) -> Any:
    """A `langchain_openai.ChatOpenAI` for the current rollout (kwargs pass through)."""
    from langchain_openai import ChatOpenAI

    endpoint = sidecar_endpoint(sidecar_url, rollout)
    headers = {**endpoint.headers, **kwargs.pop("default_headers", {})}
    return ChatOpenAI(
        model=model, base_url=endpoint.base_url, api_key=endpoint.api_key, default_headers=headers, **kwargs
    )
