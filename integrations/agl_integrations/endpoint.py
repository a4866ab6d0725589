"""Where a harness sends its model calls: the sidecar URL with the rollout prefix, and the headers
that attribute a call to the rollout (x-agl-*, traceparent, baggage)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import agl
from agl import Rollout, semconv
from agl.semconv import PLACEHOLDER_API_KEY


@dataclass(frozen=True)
class SidecarEndpoint:
    base_url: str  # OpenAI style, ends with /v1: http://sidecar/rollouts/ID/v1
    headers: dict[str, str] = field(default_factory=dict)
    api_key: str = PLACEHOLDER_API_KEY

    @property
    def root_url(self) -> str:
        """Without the trailing /v1, as the Anthropic SDK and ANTHROPIC_BASE_URL expect."""
        return self.base_url.removesuffix("/v1")


def sidecar_endpoint(sidecar_url: str | None = None, rollout: Rollout | None = None) -> SidecarEndpoint:
    """The endpoint for calls made now: inside `with agl.rollout()` (or for `rollout`), the
    sidecar URL gets the rollout's prefix and the headers its identity and trace context.

    `sidecar_url` defaults to OPENAI_BASE_URL, which agl's runners set to the rollout's URL.
    """
    rollout = rollout or agl.current_rollout()
    if sidecar_url is None:
        sidecar_url = os.environ.get(semconv.ENV_OPENAI_BASE_URL)
        if not sidecar_url:
            raise ValueError(
                "agl_integrations: no sidecar URL; pass sidecar_url='http://HOST:PORT' or set OPENAI_BASE_URL "
                "(agl's runners set it for every rollout)"
            )
    if rollout is not None and "/rollouts/" not in sidecar_url:
        base_url = rollout.base_url(sidecar_url)
    else:
        base_url = sidecar_url.rstrip("/")
        if not base_url.endswith("/v1"):
            base_url += "/v1"
    headers = rollout.headers() if rollout is not None else {}
    api_key = os.environ.get(semconv.ENV_OPENAI_API_KEY) or PLACEHOLDER_API_KEY
    return SidecarEndpoint(base_url=base_url, headers=headers, api_key=api_key)
