"""litellm, imported on first use: `import litellm` costs about 3 s, and a sidecar that serves only
chat completions must start without it."""

from __future__ import annotations

import os
from functools import cache
from typing import Any


@cache
def anthropic_adapter() -> Any:
    """litellm's Anthropic Messages <-> OpenAI chat translator (stateless, so shared)."""
    _quiet_litellm()
    from litellm.llms.anthropic.messages.adapters.transformation import LiteLLMAnthropicMessagesAdapter

    return LiteLLMAnthropicMessagesAdapter()


def _quiet_litellm() -> None:
    # Without these, importing litellm fetches the model cost map over the network and every
    # unknown model name ("tiny") prints a provider list to stdout.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
