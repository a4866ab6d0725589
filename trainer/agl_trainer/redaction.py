"""Secrets out of everything agl writes for others to read: the one redaction rule.

Applied to whatever leaves the process as a record: `OUTPUT_DIR/config.yaml`, receipts
(`receipt.json`, also uploaded as a tracker artifact), the config given to W&B (its run config and
debug logs) and to MLflow (params), and the CLI's error lines. What it replaces with `<redacted>`:

- the value of a key named like a secret: a name whose words (split at `_`, `-`, `.` and case)
  include token, secret, password, passwd, key, apikey, api_key, credential(s) or authorization,
  when the value is text (`max_tokens: 512` is a count, not a secret). A name whose last word is
  `env` names an environment variable (`admin_token_env`), not a secret, and is kept;
- every value of `harness.env` (variables for the harness: API keys travel there);
- the user and password of any URL (`http://user:pass@host` -> `http://<redacted>@host`), in any
  value and in free text.

The files that must hold secrets are not records and are not redacted: `OUTPUT_DIR/auth.json` and
`OUTPUT_DIR/harness.env` (both 0600).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

REDACTED = "<redacted>"
SECRET_WORDS = frozenset(
    {"token", "secret", "password", "passwd", "key", "apikey", "credential", "credentials", "authorization"}
)
ALWAYS_SECRET = (("harness", "env"),)  # every value under a key at the end of these paths (the config's, a receipt's)

MIN_SCRUB_CHARS = 6  # a shorter value ("1", "yes") is not searched for in free text: it would blank out words
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#@\s]+@")


def is_secret_key(name: str) -> bool:
    """Whether a config key's value is a secret, by the words of its name (see the module's rule)."""
    words = [word.lower() for word in _WORDS.findall(str(name))]
    if not words or words[-1] == "env":
        return False
    return any(word in SECRET_WORDS for word in words) or "api_key" in str(name).lower()


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every URL's user and password, and each of `secrets` (values known to be
    secrets, e.g. `secret_values(config)`), replaced by `<redacted>`."""
    text = _USERINFO.sub(lambda match: f"{match.group(1)}{REDACTED}@", text)
    for secret in sorted(set(secrets), key=len, reverse=True):
        if secret and secret != REDACTED:
            text = text.replace(secret, REDACTED)
    return text


def redact(value: Any, path: tuple[str, ...] = ()) -> Any:
    """A copy of a JSON-like value (dicts, lists, scalars: a resolved config, a receipt) with its
    secrets replaced: see the module's rule. `path` is where `value` sits in the config."""
    if isinstance(value, dict):
        return {key: _redact_item(key, item, (*path, str(key))) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact(item, path) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _is_secret(path: tuple[str, ...]) -> bool:
    """The value at `path` is a secret: its key's name says so, or it is under harness.env."""
    parent = path[:-1]
    return any(parent[-len(root) :] == root for root in ALWAYS_SECRET) or is_secret_key(path[-1])


def _redact_item(key: Any, item: Any, path: tuple[str, ...]) -> Any:
    if _is_secret(path):
        return _all_text_redacted(item)
    return redact(item, path)


def _all_text_redacted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _all_text_redacted(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_all_text_redacted(item) for item in value]
    if isinstance(value, str):
        return REDACTED if value else value
    return value


def redact_argv(argv: Iterable[str], secrets: Iterable[str] = ()) -> list[str]:
    """A command line with its secrets redacted: the value of `--KEY=VALUE` / `--KEY VALUE` when
    KEY's last part is a secret's name or KEY is under harness.env, URL users and passwords, and
    each of `secrets` wherever it appears (a mapping typed as one flag: `--engine.options={...}`)."""
    secrets = list(secrets)
    out: list[str] = []
    hide_next = False
    for item in argv:
        if hide_next and not item.startswith("-"):  # the flag's value (a switch such as --no-api-key has none)
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        flag, equals, _ = item.partition("=")
        secret_flag = flag.startswith("-") and _secret_flag(flag.lstrip("-"))
        if secret_flag and equals:
            out.append(f"{flag}={REDACTED}")
            continue
        hide_next = secret_flag
        out.append(redact_text(item, secrets))
    return out


def _secret_flag(name: str) -> bool:
    parts = tuple(name.replace("-", "_").split("."))
    return any(parts[: len(root)] == root for root in ALWAYS_SECRET) or _is_secret(parts)


def secret_values(value: Any, path: tuple[str, ...] = ()) -> set[str]:
    """Every text the rule would redact in `value` (values of secret keys, `harness.env` values,
    URL passwords and users), for scrubbing free text that may quote them."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            where = (*path, str(key))
            if _is_secret(where):
                found |= {text for text in _texts(item) if len(text) >= MIN_SCRUB_CHARS}
            else:
                found |= secret_values(item, where)
    elif isinstance(value, list | tuple):
        for item in value:
            found |= secret_values(item, path)
    elif isinstance(value, str):
        for match in _USERINFO.finditer(value):
            userinfo = match.group(0)[len(match.group(1)) : -1]
            found |= {part for part in (userinfo, *userinfo.split(":", 1)) if len(part) >= MIN_SCRUB_CHARS}
    return found


def _texts(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [text for item in value.values() for text in _texts(item)]
    if isinstance(value, list | tuple):
        return [text for item in value for text in _texts(item)]
    return [value] if isinstance(value, str) else []
