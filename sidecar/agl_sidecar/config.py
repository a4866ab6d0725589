"""The sidecar's configuration: one typed Struct, filled from defaults < YAML file < environment
(AGL_SIDECAR_*) < command line, and validated with errors that name the key and the fix."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from agl import semconv
from agl._yaml import load_yaml as parse_yaml
from agl_sidecar.inputs import INT64_MAX, INT64_MIN
from agl_sidecar.proxy.routing import validate_upstream

ENV_PREFIX = "AGL_SIDECAR_"
DEFAULT_LISTEN = "127.0.0.1:8400"
MAX_SECONDS = 365 * 24 * 3600.0  # the longest wait a setting may ask for: finite (an event loop timer of inf raises)


def default_spool_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "agl-sidecar", "spool")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


class SidecarConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    upstream: list[str] = []
    listen: str = DEFAULT_LISTEN
    otlp_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"
    otlp_headers: dict[str, str] = {}
    # gzip | none | auto (gzip, but on loopback only requests mostly made of prompts sent before)
    otlp_compression: str = "auto"
    admin_token: str | None = None
    api_key: str | None = None
    rollout_api_keys: dict[str, str] = {}
    # Off loopback without an API key anyone who reaches the port uses the engine and writes training
    # data: refused unless this says the network is private (as `agl receive --no-token`).
    no_api_key: bool = False
    max_hold_s: float = 600.0
    spool_dir: str = msgspec.field(default_factory=default_spool_dir)
    spool_max_bytes: int = 8 * 1024**3
    # Each call's span is fsync-ed to the spool before the harness gets the call's last byte (see durable.py)
    durable_spans: bool = False
    export_batch_bytes: int = 3 * 1024 * 1024
    export_memory_bytes: int = 64 * 1024 * 1024
    export_interval_s: float = 0.25
    health_interval_s: float = 5.0
    upstream_timeout_s: float | None = None
    # A connection that has not sent a whole request head this long after it opened (or after its last
    # answer: the keep-alive idle time too) is closed; a body not whole this long after its head is a
    # 408. A slow or stalled client cannot hold descriptors until harness calls fail.
    header_timeout_s: float = 60.0
    body_timeout_s: float = 120.0
    prompt_ref_memory_bytes: int = 256 * 1024 * 1024
    # Encoded slices of token arrays the engine sent before (conversations resend their past); 0: off
    token_cache_bytes: int = 64 * 1024 * 1024
    sampling: dict[str, dict[str, Any]] = {}
    default_mode: str | None = None
    # Set: every attributed call gets the engine seed proxy.request.call_seed derives from it (agl eval)
    sampling_seed: int | None = None
    capture_messages: bool = False
    inject_token_ids: bool = True
    upstream_api_key: str | None = None
    litellm_params: dict[str, Any] = {}
    policy_version: int = 0
    # Largest request body accepted (harness calls and admin requests); larger ones get 413
    max_body_bytes: int = 32 * 1024 * 1024
    # Largest non-streamed engine answer read (decompressed); a larger one is the harness's 502, not
    # a sidecar grown until it is killed with every call in flight. 128k tokens with 20 top
    # logprobs each are about 150 MB.
    max_response_bytes: int = 512 * 1024 * 1024
    service_name: str = "agl-sidecar"
    log_level: str = "warning"

    @property
    def compress_export(self) -> bool | str:
        """The exporter's `compress`: True (gzip), False, or "repeats" (auto on loopback: gzip only a
        request mostly made of prompts sent before, whose kept deflate streams cost less to copy than
        their raw bytes cost to send; anything else goes raw, where compressing only costs CPU)."""
        if self.otlp_compression != "auto":
            return self.otlp_compression == "gzip"
        from urllib.parse import urlsplit

        from agl_sidecar.spans.exporter import REPEATS

        return REPEATS if is_loopback(urlsplit(self.otlp_endpoint or "").hostname or "") else True

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)


# Keys given as lists when repeated on the command line / comma-separated in the environment.
_LIST_KEYS = {"upstream"}
_DICT_KEYS = {"otlp_headers", "rollout_api_keys"}


def env_values(environ: dict[str, str]) -> dict[str, Any]:
    """AGL_SIDECAR_<KEY> variables as config values (lists comma-separated, maps k=v,k=v)."""
    values: dict[str, Any] = {}
    for name in SidecarConfig.__struct_fields__:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        if name in _LIST_KEYS:
            values[name] = [item.strip() for item in raw.split(",") if item.strip()]
        elif name in _DICT_KEYS:
            pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
            values[name] = {k.strip(): v.strip() for k, v in pairs}
        else:
            values[name] = raw
    return values


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read the file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build(*layers: dict[str, Any]) -> SidecarConfig:
    """Merge layers (later wins) and validate."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    try:
        config = msgspec.convert(merged, SidecarConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc)) from None
    validate(config)
    return config


def _explain(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1] if "`" in text else "?"
        known = ", ".join(SidecarConfig.__struct_fields__)
        return f"unknown setting {field!r}; known settings: {known}"
    where = text.rsplit("at `$.", 1)
    key = where[1].rstrip("`") if len(where) == 2 else "?"
    return f"setting {key!r}: {where[0].rstrip(' -')}"


def is_loopback(host: str) -> bool:
    """'localhost', or an IP literal in 127/8 or ::1 (brackets and an IPv6 zone off). The rule of the
    listen check and of the admin API's callers when no admin token is set."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


# RFC 9110 5.6.2: a field name is a token
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_GRPC_KEY = re.compile(r"[0-9a-z_.\-]+")  # gRPC ASCII metadata keys (lowercased; not "-bin")


def _validate_otlp_headers(headers: dict[str, str], protocol: str) -> None:
    """Every export request carries these: one aiohttp refuses to send killed each export cycle, a
    name the endpoint refuses dead-lettered every span. Refused here, before anything is sent."""
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ConfigError(
                f"setting 'otlp_headers' name {name!r} is not an HTTP header name (letters, digits and "
                "!#$%&'*+-.^_`|~ only; no spaces or colons): e.g. authorization=Bearer TOKEN"
            )
        if protocol == "grpc" and (not _GRPC_KEY.fullmatch(name.lower()) or name.lower().endswith("-bin")):
            raise ConfigError(
                f"setting 'otlp_headers' name {name!r} is not gRPC metadata (letters, digits, '-', '_', '.'; "
                "not ending in -bin) as --otlp-protocol grpc sends it"
            )
        if not all(char == "\t" or " " <= char <= "~" for char in value):
            raise ConfigError(
                f"setting 'otlp_headers' value of {name!r} must be printable ASCII (no line breaks or control "
                "characters): it is sent as a header on every export request"
            )


def validate(config: SidecarConfig) -> None:
    if not config.upstream:
        raise ConfigError("no upstream: pass --upstream URL (a vLLM server, e.g. http://127.0.0.1:8000) "
                          "or --upstream litellm:<provider/model>, or set AGL_SIDECAR_UPSTREAM")
    for url in config.upstream:
        problem = validate_upstream(url)
        if problem:
            raise ConfigError(f"setting 'upstream': {problem}")
    host, _, port = config.listen.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"setting 'listen': {config.listen!r} must be HOST:PORT, e.g. 127.0.0.1:8400")
    on_loopback = not host.strip("[]") or is_loopback(host)  # no host: the sidecar listens on 127.0.0.1
    if not (config.api_key or config.rollout_api_keys or config.no_api_key or on_loopback):
        raise ConfigError(
            f"setting 'listen': {config.listen} is not loopback and no API key is set: anyone who reaches the "
            "port could use the engine through the sidecar and write training data (fix: pass --api-key KEY "
            "or set AGL_SIDECAR_API_KEY, and give harnesses 'Authorization: Bearer KEY'; or pass --no-api-key "
            "on a private network)"
        )
    key = config.upstream_api_key
    if key and not (key.isascii() and key.isprintable()):  # it goes out as a header ("" is no key)
        raise ConfigError(
            "setting 'upstream_api_key' must be printable ASCII (no line breaks or control characters): it is "
            "sent to the engine as 'Authorization: Bearer KEY'"
        )
    _validate_otlp_headers(config.otlp_headers, config.otlp_protocol)
    if config.otlp_endpoint is not None and not config.otlp_endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"setting 'otlp_endpoint': {config.otlp_endpoint!r} must be a URL such as http://127.0.0.1:4318"
        )
    if config.otlp_compression not in ("gzip", "none", "auto"):
        raise ConfigError(f"setting 'otlp_compression': {config.otlp_compression!r} must be gzip, none or auto")
    if config.otlp_protocol not in ("http/protobuf", "grpc"):
        raise ConfigError(f"setting 'otlp_protocol': {config.otlp_protocol!r} must be 'http/protobuf' or 'grpc'")
    for key in ("max_hold_s", "export_interval_s", "health_interval_s", "upstream_timeout_s", "header_timeout_s",
                "body_timeout_s"):
        value = getattr(config, key)
        # `not 0 < value <= MAX`: NaN and inf (YAML .nan, .inf) fail it too
        if value is not None and not 0 < value <= MAX_SECONDS:
            raise ConfigError(f"setting {key!r} must be a number of seconds > 0 and <= {MAX_SECONDS:g}, got {value}")
    for key in ("spool_max_bytes", "export_memory_bytes", "prompt_ref_memory_bytes", "token_cache_bytes"):
        if getattr(config, key) < 0:
            raise ConfigError(f"setting {key!r} must be >= 0 bytes, got {getattr(config, key)}")
    if config.max_body_bytes <= 0:
        raise ConfigError(f"setting 'max_body_bytes' must be > 0 bytes, got {config.max_body_bytes}")
    if config.max_response_bytes <= 0:
        raise ConfigError(f"setting 'max_response_bytes' must be > 0 bytes, got {config.max_response_bytes}")
    if not 4096 <= config.export_batch_bytes <= 4 * 1024 * 1024:
        raise ConfigError("setting 'export_batch_bytes' must be between 4096 and 4194304 (collectors refuse more)")
    for mode, overrides in config.sampling.items():
        if mode not in semconv.MODES:
            raise ConfigError(f"setting 'sampling': mode {mode!r} is not one of {list(semconv.MODES)}")
        for key, value in overrides.items():
            if not isinstance(value, int | float | str | bool | list) or isinstance(value, dict):
                raise ConfigError(f"setting 'sampling.{mode}.{key}': {value!r} is not a JSON scalar or list")
    if config.default_mode is not None and config.default_mode not in semconv.MODES:
        raise ConfigError(f"setting 'default_mode': {config.default_mode!r} is not one of {list(semconv.MODES)}")
    if not 0 <= config.policy_version <= INT64_MAX:
        raise ConfigError(f"setting 'policy_version' must be from 0 to {INT64_MAX}, got {config.policy_version}")
    for mode, overrides in config.sampling.items():
        for key, value in overrides.items():
            if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
                raise ConfigError(f"setting 'sampling.{mode}.{key}': {value} is out of the int64 range")
            # The call's span copies these: a value of another type would cost the span.
            if key in ("temperature", "top_p") and (
                isinstance(value, bool) or not isinstance(value, int | float) or not -INT64_MAX < value < INT64_MAX
            ):  # the range test also refuses NaN and infinities (YAML .nan, .inf)
                raise ConfigError(f"setting 'sampling.{mode}.{key}': {value!r} must be a finite number")
            if key in ("max_tokens", "n") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"setting 'sampling.{mode}.{key}': {value!r} must be an integer")
    if config.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError("setting 'log_level' must be one of debug, info, warning, error")
