"""Token ids -> text with the model's tokenizer (the viewer's pages and `agl traces inspect`).

Each token is decoded on its own (so every token keeps its own colour, version and logprob), with
a cache per id: a vocabulary repeats, so a 20k-token rollout costs a few thousand decodes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class TokenizerError(Exception):
    """The tokenizer at a path cannot be loaded (the message says which path and why)."""


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a model or tokenizer directory (no download)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 (any loading failure is the user's path's problem)
        raise TokenizerError(f"cannot load a tokenizer from {path}: {error}") from None


class TokenDecoder:
    """Decodes token ids one by one, cached; without a tokenizer a token's text is its id."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def decodes(self) -> bool:
        return self.tokenizer is not None

    def texts(self, ids: Sequence[int]) -> list[str]:
        if self.tokenizer is None:
            return [str(int(token)) for token in ids]
        with self._lock:
            missing = sorted({int(t) for t in ids} - self._cache.keys())
            if missing:
                decoded = self.tokenizer.batch_decode([[t] for t in missing], skip_special_tokens=False)
                self._cache.update(zip(missing, decoded, strict=True))
            return [self._cache[int(t)] for t in ids]
