"""Which front protocols the sidecar mounts, by path under `/v1`. Adapters are imported on first
use (they pull litellm, which costs seconds), so a sidecar that serves only chat starts fast."""

from __future__ import annotations

import asyncio
import importlib
import threading
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


_prepared: dict[str, ProtocolAdapter] = {}
_preparing = threading.Lock()


def _prepare(path: str) -> ProtocolAdapter:
    with _preparing:  # concurrent first calls wait for one import
        adapter = adapter_for(path)
        adapter.prepare()
        return adapter


async def load_adapter(path: str) -> ProtocolAdapter:
    """`adapter_for(path)`, its imports done in a worker thread the first time: importing litellm on
    the event loop would stall every call the sidecar is serving for seconds."""
    adapter = _prepared.get(path)
    if adapter is None:
        adapter = _prepared[path] = await asyncio.to_thread(_prepare, path)
    return adapter


def clear_caches() -> None:
    """Forget loaded adapters (after ADAPTERS changed)."""
    adapter_for.cache_clear()
    _prepared.clear()
