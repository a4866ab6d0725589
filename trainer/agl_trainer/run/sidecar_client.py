"""The trainer's side of the sidecar: start `agl-sidecar` as a subprocess and drive its admin API.

The trainer never imports agl_sidecar; they talk HTTP only. Admin API (bearer token):

    POST /agl/v1/pause   {"drain": true, "timeout_s": 60}  new calls held; answers once drained
                         and the drained calls' spans are sent
    POST /agl/v1/pause   {"mode": "keep"}  new calls held, in-flight ones frozen by the engine
    POST /agl/v1/resume  {"policy_version": 3, "upstreams": [...]}  held calls go out
                         (+ "switch": true, "engine_progress": {id: tokens}: after a keep pause)
    GET  /agl/v1/state
    POST /rollouts/{id}/reward {"value": 1.0, "name": "reward"}   (a grader's reward)

    async with SidecarAdmin(url, token) as admin:
        await admin.pause(drain=True, timeout_s=60)
        await admin.resume(Resume(policy_version=3))
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
from agl import semconv

from agl_trainer.addresses import is_loopback
from agl_trainer.loop.ports import RELEASE, Resume, SidecarError, SidecarState
from agl_trainer.addresses import free_port


_decode_state = msgspec.json.Decoder(SidecarState).decode


class SidecarAdmin:
    """Async client for the admin API."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 30.0, harness_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        # Rewards go to a harness route: with a harness key set, the sidecar wants that key there.
        self._reward_headers = {"authorization": f"Bearer {harness_key}"} if harness_key else None
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s)

    async def __aenter__(self) -> SidecarAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def pause(self, *, drain: bool = True, timeout_s: float = 60.0, keep: bool = False) -> SidecarState:
        """Hold new calls; with `drain`, return once in-flight calls have finished and the endpoint
        has acknowledged their spans (`spans_flushed` false: not within `timeout_s`; the state says
        how many are still undelivered). `keep` (a drain-free switch: the engine freezes the calls in
        flight): wait for none of them, deliver the spans of the calls already finished."""
        body: dict[str, Any] = {"mode": "keep", "timeout_s": timeout_s} if keep else {"drain": drain, "timeout_s": timeout_s}
        return await self._post(semconv.ADMIN_PAUSE_PATH, body, timeout=timeout_s + 10)

    async def resume(self, request: Resume = RELEASE) -> SidecarState:
        """Release held calls (`loop.ports.Resume` says what each field means)."""
        body: dict[str, Any] = {}
        if request.policy_version is not None:
            body["policy_version"] = request.policy_version
        if request.upstreams is not None:
            body["upstreams"] = request.upstreams
        if request.switch:
            body["switch"] = True
            if request.engine_progress is not None:
                body["engine_progress"] = request.engine_progress
        return await self._post(semconv.ADMIN_RESUME_PATH, body)

    async def flush(self, timeout_s: float = 30.0) -> SidecarState:
        """Deliver the spans of every call finished so far, holding none (`spans_flushed` false: not
        within `timeout_s`; the state says how many are still undelivered)."""
        return await self._post(semconv.ADMIN_FLUSH_PATH, {"timeout_s": timeout_s}, timeout=timeout_s + 10)

    async def state(self) -> SidecarState:
        response = await self._client.get(semconv.ADMIN_STATE_PATH)
        _raise_for(response, "state")
        return _decode_state(response.content)

    async def emit_reward(self, rollout_id: str, value: float, name: str = "reward") -> None:
        path = f"{semconv.ROLLOUT_PATH_PREFIX}/{rollout_id}{semconv.REWARD_PATH}"
        response = await self._client.post(path, json={"value": value, "name": name}, headers=self._reward_headers)
        _raise_for(response, "reward")

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> SidecarState:
        kwargs: dict[str, Any] = {"json": body}
        if timeout is not None:
            kwargs["timeout"] = timeout
        response = await self._client.post(path, **kwargs)
        _raise_for(response, path.rsplit("/", 1)[-1])
        return _decode_state(response.content)


def _raise_for(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        raise SidecarError(f"sidecar {what} failed: HTTP {response.status_code} {response.text[:500]}")


def default_executable() -> str:
    """`agl-sidecar` next to the running Python (the same venv), else on PATH."""
    candidate = Path(sys.executable).parent / "agl-sidecar"
    return str(candidate) if candidate.exists() else "agl-sidecar"


def stop_orphan(pid_file: Path) -> None:
    """Stop the sidecar a crashed run left behind (its pid file is still there)."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if b"agl-sidecar" in cmdline or b"agl_sidecar" in cmdline:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.05)
    pid_file.unlink(missing_ok=True)


class SidecarProcess:
    """`agl-sidecar` as a child process on loopback; `start()` returns once /healthz answers."""

    def __init__(
        self,
        upstreams: list[str],
        otlp_endpoint: str,
        *,
        executable: str | None = None,
        admin_token: str | None = None,
        log_path: Path | None = None,
        config_path: Path | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 30.0,
        pid_file: Path | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        api_key: str | None = None,
        otlp_headers: dict[str, str] | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.listen_host = listen_host  # 0.0.0.0 / :: listen everywhere; the trainer dials it on loopback
        self.listen_port = listen_port  # 0: a free one
        self.api_key = api_key  # the key harnesses must send (AGL_SIDECAR_API_KEY)
        self.otlp_headers = otlp_headers or {}  # e.g. the receiver's bearer token
        self.otlp_endpoint = otlp_endpoint
        self.executable = executable or default_executable()
        self.admin_token = admin_token or secrets.token_urlsafe(16)
        self.log_path = log_path
        self.config_path = config_path
        self.extra_args = extra_args or []
        self.startup_timeout_s = startup_timeout_s
        self.pid_file = pid_file  # lets the next run stop a sidecar orphaned by a crashed trainer
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        """Where this machine reaches it (a wildcard listen through loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.listen_host, self.listen_host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def command(self) -> list[str]:
        listen = f"{self.listen_host}:{self.port}"
        argv = [self.executable, "--listen", listen, "--otlp-endpoint", self.otlp_endpoint]
        for upstream in self.upstreams:
            argv += ["--upstream", upstream]
        # The admin token goes in the environment (see start()): not visible in `ps`, and a token
        # that starts with "-" cannot be mistaken for a flag.
        if self.config_path is not None:
            argv += ["--config", str(self.config_path)]
        if self.api_key is None and not is_loopback(self.listen_host.strip("[]")):
            argv.append("--no-api-key")  # sidecar.auth: false off loopback, the config's explicit choice
        return argv + self.extra_args

    def start(self) -> None:
        if self.pid_file is not None:
            stop_orphan(self.pid_file)
        self.port = self.listen_port or free_port(self.listen_host)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        out = self._log if self._log is not None else subprocess.DEVNULL
        try:
            self._process = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self._secret_env()},
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SidecarError(
                f"cannot run {self.executable!r}: not found (fix: install agl with the sidecar extra, "
                "or set sidecar.executable)"
            ) from None
        if self.pid_file is not None:
            self.pid_file.write_text(str(self._process.pid))
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._close_log()
                raise SidecarError(
                    f"agl-sidecar exited with code {self._process.returncode} during start-up"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise SidecarError(f"agl-sidecar did not answer /healthz within {self.startup_timeout_s:.0f} s")

    def _secret_env(self) -> dict[str, str]:
        env = {semconv.ENV_SIDECAR_ADMIN_TOKEN: self.admin_token}
        if self.api_key:
            env[semconv.ENV_SIDECAR_API_KEY] = self.api_key
        if self.otlp_headers:
            env[semconv.ENV_SIDECAR_OTLP_HEADERS] = ",".join(f"{k}={v}" for k, v in self.otlp_headers.items())
        return env

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (it flushes its spans), then SIGKILL after `timeout_s`; safe to call twice."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SidecarProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
