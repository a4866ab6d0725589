"""Which front protocols the sidecar mounts, by path under `/v1`. Adapters are imported on first
use (they pull litellm, which costs seconds), so a sidecar that serves only chat starts fast."""

from __future__ import annotations

import importlib
from functools import cache

from agl_sidecar.protocols.base import ProtocolAdapter

# path under /v1 -> "module:attribute" of a ProtocolAdapter
ADAPTERS: dict[str, str] = {
    "/messages": "agl_sidecar.protocols.anthropic:MESSAGES",
    "/messages/count_tokens": "agl_sidecar.protocols.anthropic:COUNT_TOKENS",
    "/responses": "agl_sidecar.protocols.responses:RESPONSES",
}


@cache
def adapter_for(path: str) -> ProtocolAdapter:
    """The adapter mounted at `path` (a key of ADAPTERS)."""
    module_name, attribute = ADAPTERS[path].split(":")
    return getattr(importlib.import_module(module_name), attribute)
