"""The OpenAI Agents SDK (`openai-agents`) through the sidecar.

    with agl.rollout(task_id="t1"):
        result = Runner.run_sync(agent, task, run_config=run_config("my-model", "http://127.0.0.1:8080"))
        agl.emit_reward(score(result.final_output))

`api="responses"` (the SDK's default) uses the sidecar's /v1/responses; `api="chat"` uses chat
completions, the cheapest path through the sidecar.
"""

from __future__ import annotations

from typing import Any, Literal

from agl import Rollout

from agl_integrations.endpoint import sidecar_endpoint


def agents_model(
    model: str,
    sidecar_url: str | None = None,
    *,
    api: Literal["responses", "chat"] = "responses",
    rollout: Rollout | None = None,
) -> Any:
    """An Agents SDK `Model` whose calls go to the sidecar for the current rollout."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel
    from openai import AsyncOpenAI

    if api not in ("responses", "chat"):
        raise ValueError(f"agents_model: api must be 'responses' or 'chat', got {api!r}")
    endpoint = sidecar_endpoint(sidecar_url, rollout)
    client = AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.api_key, default_headers=endpoint.headers
    )
    if api == "chat":
        return OpenAIChatCompletionsModel(model=model, openai_client=client)
    return OpenAIResponsesModel(model=model, openai_client=client)


def run_config(model: str, sidecar_url: str | None = None, **kwargs: Any) -> Any:
    """A `RunConfig` using `agents_model(...)`, with the SDK's own trace upload to OpenAI turned off
    (agl's spans already record every call; the upload needs an OpenAI key and network)."""
    from agents import RunConfig

    api = kwargs.pop("api", "responses")
    rollout = kwargs.pop("rollout", None)
    kwargs.setdefault("tracing_disabled", True)
    return RunConfig(model=agents_model(model, sidecar_url, api=api, rollout=rollout), **kwargs)
