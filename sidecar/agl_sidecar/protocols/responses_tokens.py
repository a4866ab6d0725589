"""The sidecar's own `encrypted_content`: what a harness carries back opaque, for the sidecar to read.

With `store: false` a Responses client keeps the conversation and sends it back whole, a reasoning
item's and a compaction item's `encrypted_content` included, opaque to it (Codex does). The sidecar
puts its own token there: the exact text the engine wrote (its reasoning, or the summary of a
compaction), so the next call renders the same text, hence the same tokens, back into the prompt,
and the call extends the previous one token for token.

    agl1.<base64url of {"k": kind, "t": text}>.<base64url of a keyed 16-byte BLAKE2b of that JSON>

The checksum makes a token that was changed or cut on the way back evident (it is then not read,
and the span says so); it is no secret: a harness can put any text in its history anyway, so a
forged token gains it nothing. Tokens need no state in the sidecar: a restarted or another sidecar
reads them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

import msgspec

REASONING = "reasoning"
COMPACTION = "compaction"
PREFIX = "agl1."
_KEY = b"agl-sidecar responses token v1"
_encode = msgspec.json.Encoder().encode


class _Sealed(msgspec.Struct):
    k: str
    t: str


_decode = msgspec.json.Decoder(_Sealed).decode


def seal(kind: str, text: str) -> str:
    """A token holding `text` as `kind`."""
    payload = _encode(_Sealed(kind, text))
    return PREFIX + _b64(payload) + "." + _b64(_mac(payload))


def unseal(token: str, kind: str) -> str | None:
    """The text `token` holds, if it is a whole token of `kind` made by a sidecar; else None."""
    if not token.startswith(PREFIX):
        return None
    body, _, mac = token[len(PREFIX) :].rpartition(".")
    try:
        payload = _unb64(body)
        if _b64(_mac(payload)) != mac:
            return None
        sealed = _decode(payload)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        return None
    return sealed.t if sealed.k == kind else None


def _mac(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, key=_KEY, digest_size=16).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
