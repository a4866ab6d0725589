"""Who may read the viewer: the Host check on loopback (DNS rebinding) and the token off loopback.

The viewer shows every prompt, completion and log of a store. On a loopback address it answers
only requests that name a loopback host: a web page elsewhere that points its own domain name at
127.0.0.1 sends its own name as Host and is refused. Off loopback it needs a token (the same rule
as `agl receive`): a client sends `Authorization: Bearer <token>`, or a browser opens the page once
with `?token=<token>`, which sets a cookie (HttpOnly, SameSite=Strict) and redirects to the URL
without it. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

from agl_trainer.addresses import is_loopback

COOKIE = "agl_viewer_token"
QUERY = "token"


class AccessError(ValueError):
    """A listen address and token that would serve the store to anyone (the message says the fix)."""


def is_loopback_host_header(value: str) -> bool:
    """A Host header naming this machine's loopback: 'localhost', an IPv4 literal in 127/8 (dotted
    quad, exactly) or '[::1]', each with an optional port. '127.0.0.1.evil.example' is a domain
    name, not an address: refused."""
    if value.startswith("["):
        name, closed, rest = value[1:].partition("]")
        if not closed or (rest and not (rest.startswith(":") and _port_ok(rest[1:]))):
            return False
        return _loopback_literal(ipaddress.IPv6Address, name)
    name, colon, port = value.partition(":")
    if colon and not _port_ok(port):
        return False
    return name.lower() == "localhost" or _loopback_literal(ipaddress.IPv4Address, name)


def _loopback_literal(parse: Callable[[str], ipaddress._BaseAddress], text: str) -> bool:
    """`text` is an address literal of the kind `parse` reads, and a loopback one."""
    try:
        return parse(text).is_loopback
    except ValueError:
        return False


def _port_ok(port: str) -> bool:
    return port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) <= 65535


def check_listen(host: str, token: str | None, allow_no_token: bool, token_hint: str) -> None:
    """Refuse to serve a store off loopback without a token (unless told it is a private network)."""
    if token is None and not allow_no_token and not is_loopback(host):
        raise AccessError(
            f"the viewer would listen on {host}, off loopback, without a token: anyone who reaches the port"
            f" could read every prompt, completion and log in the store (fix: {token_hint})"
        )


def token_matches(given: str | None, token: str) -> bool:
    if not given:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode("utf-8"))


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None
