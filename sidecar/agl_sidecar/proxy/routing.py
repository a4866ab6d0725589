"""Upstream replicas and sticky routing.

Every call of a rollout goes to the same replica (its KV prefix cache holds the rollout's growing
prompt): rendezvous hashing over the healthy replicas, so when one is taken out only its own
rollouts move, and they come back when it recovers. Calls with no rollout go to the least busy
replica. A replica is taken out when a connection to it is refused, or after FAILED_PROBES_OUT
failed `/health` probes in a row (one slow probe from a busy replica must not move its rollouts and
lose their prefix cache); it returns on a passing probe.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import re
import zlib
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp

log = logging.getLogger("agl_sidecar.routing")

LITELLM_PREFIX = "litellm:"
FAILED_PROBES_OUT = 3


class NoUpstream(Exception):
    """No healthy upstream replica is configured."""


class Upstream:
    """One replica. `url` never holds credentials (it is shown in spans, /agl/v1/state and logs):
    `http://user:pass@host` is kept as `http://host` plus `authorization` (Basic) for the requests."""

    __slots__ = ("url", "authorization", "healthy", "in_flight", "litellm_model", "failed_probes", "_salt")

    def __init__(self, url: str) -> None:
        self.litellm_model = url[len(LITELLM_PREFIX) :] if url.startswith(LITELLM_PREFIX) else None
        self.authorization: str | None = None
        if not self.litellm_model:
            url, self.authorization = split_credentials(url)
        self.url = url if self.litellm_model else normalize_url(url)
        self.healthy = True
        self.in_flight = 0
        self.failed_probes = 0
        self._salt = self.url.encode()

    def score(self, key: bytes) -> int:
        return zlib.crc32(key, zlib.crc32(self._salt))

    def __repr__(self) -> str:
        return f"Upstream({self.url!r}, healthy={self.healthy})"


def split_credentials(url: str) -> tuple[str, str | None]:
    """`http://user:pass@host:port/p` -> (`http://host:port/p`, `Basic base64(user:pass)`)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return urlunsplit(parts._replace(netloc=hostport)), f"Basic {token}"


def normalize_url(url: str) -> str:
    """`http://h:p/v1/` -> `http://h:p` (the sidecar appends /v1/... itself)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def validate_upstream(url: str) -> str | None:
    """A message naming what is wrong with an --upstream value, or None."""
    if url.startswith(LITELLM_PREFIX):
        return None if len(url) > len(LITELLM_PREFIX) else "litellm: needs a model, e.g. litellm:openai/gpt-4o-mini"
    try:
        shown = split_credentials(url)[0]
    except ValueError:  # urlsplit refuses it (`http://[::1`): still name it, never its credentials
        scheme, sep, rest = url.partition("://")
        shown = scheme + sep + rest.rpartition("@")[2]
    if not url.startswith(("http://", "https://")):
        return f"upstream {shown!r} must start with http://, https:// or litellm:"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        return f"upstream {shown!r} is not a valid URL ({exc})"
    if not parts.hostname:
        return f"upstream {shown!r} has no host, e.g. http://127.0.0.1:8000"
    if parts.port == 0:  # no engine listens on port 0: a connect goes nowhere (or, for some clients, to 80)
        return f"upstream {shown!r} has port 0; name the engine's port, e.g. http://127.0.0.1:8000"
    if not _valid_host(parts.hostname):
        return (f"upstream {shown!r} has a host name that is not valid (labels of letters, digits, '-' or '_', "
                "1 to 63 characters each, as IDNA encodes them): every call to it would fail")
    return None


_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _valid_host(host: str) -> bool:
    """An IP literal, or a name whose IDNA (ASCII) form is dot-separated labels a resolver takes,
    and which decodes back (a malformed `xn--` label does not)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        pass
    try:
        ascii_name = host.encode("idna")
        ascii_name.decode("idna")
    except UnicodeError:
        return False
    labels = ascii_name.decode("ascii").removesuffix(".").split(".")
    return len(ascii_name) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


class Router:
    def __init__(self, urls: Iterable[str]) -> None:
        self.upstreams: list[Upstream] = [Upstream(url) for url in urls]

    def set_urls(self, urls: Iterable[str]) -> None:
        known = {(u.url, u.authorization): u for u in self.upstreams}
        fresh = [Upstream(url) for url in urls]
        self.upstreams = [known.get((u.url, u.authorization), u) for u in fresh]

    @property
    def urls(self) -> list[str]:
        return [u.url for u in self.upstreams]

    def pick(self, rollout_id: str | None, exclude: tuple[Upstream, ...] = ()) -> Upstream:
        candidates = [u for u in self.upstreams if u.healthy and u not in exclude]
        if not candidates:
            # All marked down: try them anyway rather than fail a call on stale health.
            candidates = [u for u in self.upstreams if u not in exclude]
        if not candidates:
            raise NoUpstream
        if len(candidates) == 1:
            return candidates[0]
        if rollout_id is None:
            return min(candidates, key=lambda u: u.in_flight)
        key = rollout_id.encode()
        return max(candidates, key=lambda u: u.score(key))

    def mark_down(self, upstream: Upstream, why: str) -> None:
        if upstream.healthy:
            log.warning("agl-sidecar: upstream %s taken out: %s", upstream.url, why)
        upstream.healthy = False

    async def check_health(self, session: aiohttp.ClientSession, timeout_s: float = 5.0) -> None:
        async def probe(upstream: Upstream) -> None:
            if upstream.litellm_model:
                return
            headers = {"Authorization": upstream.authorization} if upstream.authorization else None
            try:
                async with session.get(
                    upstream.url + "/health", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as response:
                    ok = response.status == 200
                    await response.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                ok, why = False, str(exc) or type(exc).__name__
            else:
                why = f"/health answered {response.status}"
            if ok:
                upstream.failed_probes = 0
                if not upstream.healthy:
                    log.warning("agl-sidecar: upstream %s is healthy again", upstream.url)
                    upstream.healthy = True
                return
            upstream.failed_probes += 1
            if upstream.failed_probes >= FAILED_PROBES_OUT:
                self.mark_down(upstream, f"{upstream.failed_probes} failed health probes, last: {why}")

        await asyncio.gather(*(probe(u) for u in list(self.upstreams)))

    async def health_loop(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_health(session)
            except Exception:  # a probe bug must not stop probing
                log.exception("agl-sidecar: health check failed")
