"""Where `agl train`'s servers listen, the addresses the other processes use, and their secrets.

Each server has two addresses: where it listens (`sidecar.listen`, `receiver.listen`) and the URL
the others use (`sidecar.advertise_url` for harnesses, `receiver.advertise_url` for sidecars and
SDKs). A wildcard listen (0.0.0.0, ::) names no address anyone can dial, so it needs an advertised
URL. Auth is on by default (`auth: auto`) once a server is not on loopback: the sidecar's harness
key and admin token and the receiver's bearer token come from the environment variables the config
names, else they are generated, kept in OUTPUT_DIR/auth.json (mode 0600, reused by --resume) and
handed to the processes in their environment, never on a command line. `resolve` checks all of it
before anything starts; errors name the key.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from agl import semconv

from agl_trainer.addresses import is_loopback
from agl_trainer.config import Config, ConfigError

AUTH_FILE = "auth.json"
HARNESS_ENV_FILE = "harness.env"


@dataclass(frozen=True)
class Listen:
    host: str  # without brackets
    port: int

    @property
    def wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def flag(self) -> str:
        """HOST:PORT as the sidecar's --listen takes it (it splits at the last colon)."""
        return f"{self.host}:{self.port}"

    def local_url(self, port: int) -> str:
        """A URL this machine can dial to reach the server (wildcards through loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{_bracket(host)}:{port}"


@dataclass(frozen=True)
class SidecarTarget:
    """A sidecar as the trainer drives it (admin) and as harnesses reach it."""

    admin_url: str
    admin_token: str | None
    harness_url: str
    harness_key: str | None
    upstreams: list[str] | None = None  # None: the engine's URLs


@dataclass
class Topology:
    sidecar_listen: Listen
    sidecar_advertise: str | None  # None: http://LISTEN_HOST:PORT once the port is known
    harness_key: str | None
    admin_token: str
    sidecar_otlp_endpoint: str | None  # a collector; None: the receiver
    receiver_listen: Listen
    receiver_advertise: str | None
    receiver_token: str | None
    attached: list[SidecarTarget] = field(default_factory=list)

    def receiver_url(self, port: int) -> str:
        return self.receiver_advertise or self.receiver_listen.local_url(port)

    def sidecar_url(self, port: int) -> str:
        return self.sidecar_advertise or self.sidecar_listen.local_url(port)

    def otlp_headers(self) -> dict[str, str]:
        """What a sender adds to reach the receiver (the token, when there is one)."""
        return {"authorization": f"Bearer {self.receiver_token}"} if self.receiver_token else {}


def parse_listen(key: str, value: str) -> Listen:
    """HOST:PORT, [V6]:PORT; port 0 picks a free one."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536 or " " in host:
        raise ConfigError(
            f"config key {key}: {value!r} is not HOST:PORT (fix: e.g. 127.0.0.1:8400, 0.0.0.0:8400 or [::]:8400; "
            "port 0 picks a free one)"
        )
    return Listen(host, int(port))


def parse_url(key: str, value: str) -> str:
    """An http(s) base URL with a host another machine can dial; returned without a trailing slash."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"config key {key}: {value!r} is not a URL (fix: e.g. http://trainer.example:8400)")
    if parts.hostname in ("0.0.0.0", "::"):
        raise ConfigError(
            f"config key {key}: {value!r} names a wildcard address nobody can dial "
            "(fix: this machine's name or IP as the other machines see it)"
        )
    if parts.query or parts.fragment or port == 0:
        raise ConfigError(f"config key {key}: {value!r} must be a base URL with a real port and no query")
    return value.rstrip("/")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _secret(key: str, env_name: str | None, environ: Mapping[str, str], required: bool) -> str | None:
    """The value of the environment variable `env_name` names; an unset one named in the config is an error."""
    if env_name is None:
        return None
    value = environ.get(env_name)
    if not value:
        if required:
            raise ConfigError(f"config key {key}: environment variable {env_name} is not set (fix: export it)")
        return None
    return value


def _auth_on(mode: bool | str, listen: Listen) -> bool:
    return mode is True or (mode == "auto" and not listen.loopback)


def resolve(config: Config, environ: Mapping[str, str] | None = None, saved: Mapping[str, str] | None = None) -> Topology:
    """The run's addresses and secrets, checked; `saved` holds secrets generated by an earlier run."""
    environ = os.environ if environ is None else environ
    saved = dict(saved or {})
    side, recv = config.sidecar, config.receiver

    receiver_listen = parse_listen("receiver.listen", recv.listen)
    receiver_advertise = parse_url("receiver.advertise_url", recv.advertise_url) if recv.advertise_url else None
    if receiver_listen.wildcard and receiver_advertise is None:
        raise ConfigError(
            f"config key receiver.advertise_url: receiver.listen {recv.listen} is a wildcard address, so sidecars "
            f"and SDKs need the URL to send spans to (fix: set receiver.advertise_url to http://THIS_HOST:"
            f"{receiver_listen.port or 4318})"
        )
    receiver_token = _secret("receiver.token_env", recv.token_env, environ, required=True)
    if receiver_token is None and recv.auth is not False:
        receiver_token = environ.get(semconv.ENV_RECEIVER_TOKEN) or None
    if receiver_token is None and _auth_on(recv.auth, receiver_listen):
        receiver_token = saved.get("receiver_token") or secrets.token_urlsafe(24)

    sidecar_listen = parse_listen("sidecar.listen", side.listen)
    sidecar_advertise = parse_url("sidecar.advertise_url", side.advertise_url) if side.advertise_url else None
    attaching = bool(side.attach) or side.url is not None
    if sidecar_listen.wildcard and sidecar_advertise is None and not attaching:
        raise ConfigError(
            f"config key sidecar.advertise_url: sidecar.listen {side.listen} is a wildcard address, so harnesses "
            f"need the URL to call (fix: set sidecar.advertise_url to http://THIS_HOST:{sidecar_listen.port or 8400})"
        )
    otlp_endpoint = parse_url("sidecar.otlp_endpoint", side.otlp_endpoint) if side.otlp_endpoint else None
    harness_key = _secret("sidecar.harness_key_env", side.harness_key_env, environ, required=True)
    if harness_key is None and _auth_on(side.auth, sidecar_listen) and not attaching:
        harness_key = saved.get("harness_key") or secrets.token_urlsafe(24)
    admin_token = (
        _secret("sidecar.admin_token_env", side.admin_token_env, environ, required=True)
        or side.admin_token
        or saved.get("admin_token")
        or secrets.token_urlsafe(24)
    )

    attached: list[SidecarTarget] = []
    if side.url is not None:  # the older single-sidecar key
        url = parse_url("sidecar.url", side.url)
        # Its token only if one is configured: a loopback sidecar without one takes loopback admin calls.
        token = _secret("sidecar.admin_token_env", side.admin_token_env, environ, required=True) or side.admin_token
        if token is None and not is_loopback(urlsplit(url).hostname or ""):
            raise ConfigError(
                f"config key sidecar.admin_token_env: the sidecar at {url} is not on loopback, so its admin API "
                "needs its token (fix: name the variable holding it)"
            )
        attached.append(SidecarTarget(url, token, url, harness_key))
    for index, entry in enumerate(side.attach):
        key = f"sidecar.attach.{index}"
        url = parse_url(f"{key}.url", entry.url)
        token = _secret(f"{key}.admin_token_env", entry.admin_token_env, environ, required=True)
        host = urlsplit(url).hostname or ""
        if token is None and not is_loopback(host):
            raise ConfigError(
                f"config key {key}.admin_token_env: the sidecar at {url} is not on loopback, so its admin API "
                "needs its token (fix: start it with AGL_SIDECAR_ADMIN_TOKEN set and name that variable here)"
            )
        harness_url = parse_url(f"{key}.harness_url", entry.harness_url) if entry.harness_url else url
        key_value = _secret(f"{key}.harness_key_env", entry.harness_key_env, environ, required=True)
        upstreams = [parse_url(f"{key}.upstreams", u) for u in entry.upstreams] if entry.upstreams else None
        attached.append(SidecarTarget(url, token, harness_url, key_value, upstreams))
    return Topology(
        sidecar_listen=sidecar_listen,
        sidecar_advertise=sidecar_advertise,
        harness_key=harness_key,
        admin_token=admin_token,
        sidecar_otlp_endpoint=otlp_endpoint,
        receiver_listen=receiver_listen,
        receiver_advertise=receiver_advertise,
        receiver_token=receiver_token,
        attached=attached,
    )


def load_saved(out: Path) -> dict[str, str]:
    try:
        data = json.loads((out / AUTH_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def save_secrets(out: Path, topology: Topology) -> None:
    """Keep the secrets (generated or not) so --resume reuses them: harnesses elsewhere keep working."""
    data = {
        "harness_key": topology.harness_key,
        "admin_token": topology.admin_token,
        "receiver_token": topology.receiver_token,
    }
    _write_private(out / AUTH_FILE, json.dumps({k: v for k, v in data.items() if v}))


def write_harness_env(out: Path, sidecar_url: str, topology: Topology, receiver_url: str) -> Path:
    """OUTPUT_DIR/harness.env (0600): what a harness you start elsewhere needs (`set -a; . harness.env`)."""
    lines = {
        "OPENAI_BASE_URL": f"{sidecar_url}/v1",
        "ANTHROPIC_BASE_URL": sidecar_url,
        semconv.ENV_OTLP_ENDPOINT: receiver_url,
    }
    if topology.harness_key:
        lines["OPENAI_API_KEY"] = lines["ANTHROPIC_API_KEY"] = topology.harness_key
    headers = topology.otlp_headers()
    if headers:
        lines[semconv.ENV_OTLP_HEADERS] = format_headers(headers)
    path = out / HARNESS_ENV_FILE
    _write_private(path, "".join(f"{name}='{value}'\n" for name, value in lines.items()))
    return path


def format_headers(headers: Mapping[str, str]) -> str:
    """k=v,k=v as AGL_OTLP_HEADERS and AGL_SIDECAR_OTLP_HEADERS read it."""
    return ",".join(f"{k}={v}" for k, v in headers.items())


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)
