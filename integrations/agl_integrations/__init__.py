"""Thin adapters that point harness frameworks at the agl sidecar.

Each module is what a user adds to an existing harness: a client or model object whose base URL
carries the rollout prefix and whose headers carry the rollout's identity and trace context, built
from `agl.rollout()` (or the runner's environment). The harness then calls `agl.emit_reward()` once.
Every module imports its framework only when called, so `import agl_integrations` is free.

    anthropic_sdk    anthropic_client()            Anthropic Messages through the sidecar
    openai_agents    agents_model(), run_config()  OpenAI Agents SDK (Responses or chat)
    langchain        chat_model()                  LangChain / LangGraph (ChatOpenAI)
    mini_swe_agent   swe_model()                   mini-swe-agent's litellm model, or its text-based model
                                                   over the OpenAI SDK (client="openai": no litellm import)
"""

from agl_integrations.endpoint import SidecarEndpoint, sidecar_endpoint

__all__ = ["SidecarEndpoint", "sidecar_endpoint"]
