"""The HTTP calls agl makes to a vLLM OpenAI server beyond the OpenAI API: health, the models it
serves, and the dev-mode control endpoints (VLLM_SERVER_DEV_MODE=1): /pause, /resume,
/collective_rpc (the worker extension's methods), /reset_prefix_cache, /update_weight_version,
/sleep, /wake_up. Every failure is a VLLMError that names the server, the path and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agl_trainer.engines.vllm.config import LOAD_METHOD, WORKER_CLASS, WORKER_MODULE, VLLMError


class AdminClient:
    """One HTTP client for every server of an engine. `extension_dir` names where the worker
    extension lives, for the hint when a server was started without it."""

    def __init__(self, timeout_s: float, extension_dir: Callable[[], Path]) -> None:
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)
        self._extension_dir = extension_dir

    def healthy(self, url: str) -> bool:
        try:
            return self._client.get(f"{url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def models(self, url: str) -> list[dict[str, Any]]:
        """The model cards of GET /v1/models."""
        try:
            return self._client.get(f"{url}/v1/models").json().get("data") or []
        except (httpx.HTTPError, ValueError) as error:
            raise VLLMError(f"vLLM {url}/v1/models: {error}") from error

    def rpc(self, url: str, method: str, *args: object) -> list[Any]:
        """Every worker's answer to the worker extension's `method` (POST /collective_rpc)."""
        body: dict[str, Any] = {"method": method, "args": list(args)} if args else {"method": method}
        return self.post(url, "/collective_rpc", json=body).get("results") or []

    def pause(self, url: str, params: dict[str, str]) -> None:
        self.post(url, "/pause", params=params)

    def resume(self, url: str) -> None:
        self.post(url, "/resume")

    def reset_prefix_cache(self, url: str, params: dict[str, str] | None = None) -> None:
        self.post(url, "/reset_prefix_cache", params=params)

    def set_version(self, url: str, version: int) -> None:
        """Tell the server its policy version (older vLLM builds lack the endpoint: skipped)."""
        self.post(url, "/update_weight_version", json={"new_version": str(version)}, optional=True)

    def post(
        self,
        url: str,
        path: str,
        *,
        json: object | None = None,
        params: dict[str, str] | None = None,
        optional: bool = False,
    ) -> dict:
        try:
            response = self._client.post(f"{url}{path}", json=json, params=params)
        except httpx.HTTPError as error:
            raise VLLMError(f"vLLM {url}{path}: {type(error).__name__}: {error}") from error
        if response.status_code == 404 and optional:
            return {}
        if response.status_code == 404 and path != "/collective_rpc":
            raise VLLMError(
                f"vLLM {url}{path} answered 404: start the server with VLLM_SERVER_DEV_MODE=1 "
                "(managed servers get it) so its control endpoints exist"
            )
        if response.status_code >= 400:
            hint = ""
            if path == "/collective_rpc" and f"no attribute '{LOAD_METHOD}'" in response.text:
                hint = (
                    f" (is the worker extension loaded? start vLLM with --worker-extension-cls "
                    f"{WORKER_MODULE}.{WORKER_CLASS} and PYTHONPATH={self._extension_dir()})"
                )
            raise VLLMError(f"vLLM {url}{path} answered {response.status_code}: {response.text[:2000]}{hint}")
        if not response.content:
            return {}
        body = response.json()
        return body if isinstance(body, dict) else {"value": body}
