"""mini-swe-agent (the coding agent of the SWE-bench result) through the sidecar.

    with agl.rollout(task_id=instance_id):
        agent = DefaultAgent(swe_model("my-model", "http://127.0.0.1:8080"), LocalEnvironment(), **agent_config)
        result = agent.run(task)
        agl.emit_reward(1.0 if tests_pass() else 0.0)

mini-swe-agent calls models through litellm; the sidecar is an OpenAI-compatible server to it
(litellm's `hosted_vllm/` provider), so the engine's token IDs are recorded as for any chat call.
"""

from __future__ import annotations

from typing import Any

from agl import Rollout

from agl_integrations.endpoint import sidecar_endpoint


def swe_model(
    model: str,
    sidecar_url: str | None = None,
    *,
    textbased: bool = True,
    rollout: Rollout | None = None,
    **config: Any,
) -> Any:
    """A mini-swe-agent model for the current rollout. `textbased=True` parses bash blocks from the
    text (models without a tool-call parser in vLLM); False uses its tool-calling model."""
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    endpoint = sidecar_endpoint(sidecar_url, rollout)
    model_kwargs = {
        "api_base": endpoint.base_url,
        "api_key": endpoint.api_key,
        "extra_headers": endpoint.headers,
    }
    model_kwargs.update(config.pop("model_kwargs", {}))
    name = model if model.startswith(("hosted_vllm/", "openai/")) else f"hosted_vllm/{model}"
    config.setdefault("cost_tracking", "ignore_errors")  # open models have no price in litellm's table
    cls = LitellmTextbasedModel if textbased else LitellmModel
    return cls(model_name=name, model_kwargs=model_kwargs, **config)
