"""Why a call's prompt does not extend the previous sample: classify a failed merge.

    template        the difference is only special tokens (a chat template renders the turn end,
                    or drops a special block, differently from what the engine generated)
    retokenization  the same text, different tokens (the harness re-encoded generated text)
    other           anything else (the harness edited or truncated its context)

With a tokenizer (anything with `decode(ids, skip_special_tokens=...)`, e.g. a Hugging Face
tokenizer) the classes are decided on text. Without one, `special_token_ids` lets the template
class be decided exactly, and retokenization is guessed from the shape of the difference (the two
sequences re-align shortly after they diverge); `classified_by` says which was used.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np

TEMPLATE: Final = "template"
RETOKENIZATION: Final = "retokenization"
OTHER: Final = "other"

BY_TOKENIZER: Final = "tokenizer"
BY_SPECIAL_IDS: Final = "special_ids"
BY_HEURISTIC: Final = "heuristic"

_REALIGN_WINDOW = 16  # a retokenized span is short: look this far for the sequences to re-align
_TEMPLATE_TAIL = 2  # a difference only in the sequence's last tokens (turn end) looks like a template


class MergeFailure(msgspec.Struct):
    call_seq: int
    previous_call_seq: int
    kind: str  # TEMPLATE | RETOKENIZATION | OTHER
    classified_by: str  # BY_TOKENIZER | BY_SPECIAL_IDS | BY_HEURISTIC
    position: int  # index of the first token that differs
    detail: str


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def extends(prompt: np.ndarray, sequence: np.ndarray) -> bool:
    """Whether `prompt` starts with exactly `sequence`."""
    return prompt.size >= sequence.size and bool(np.array_equal(prompt[: sequence.size], sequence))


def classify(
    sequence: np.ndarray,
    prompt: np.ndarray,
    call_seq: int,
    previous_call_seq: int,
    tokenizer: Any = None,
    special_ids: np.ndarray | None = None,
) -> MergeFailure:
    position = common_prefix(sequence, prompt)

    def failure(kind: str, by: str, detail: str) -> MergeFailure:
        return MergeFailure(call_seq, previous_call_seq, kind, by, position, detail)

    if tokenizer is not None:
        seq_text = tokenizer.decode(sequence.tolist(), skip_special_tokens=False)
        prompt_text = tokenizer.decode(prompt.tolist(), skip_special_tokens=False)
        if prompt_text.startswith(seq_text):
            return failure(RETOKENIZATION, BY_TOKENIZER, "the prompt has the same text with different tokens")
        seq_plain = tokenizer.decode(sequence.tolist(), skip_special_tokens=True)
        prompt_plain = tokenizer.decode(prompt.tolist(), skip_special_tokens=True)
        if prompt_plain.startswith(seq_plain):
            return failure(TEMPLATE, BY_TOKENIZER, "the texts differ only in special tokens")
        return failure(
            OTHER, BY_TOKENIZER, f"the prompt's text differs from the sequence at token {position}"
        )

    if special_ids is not None and special_ids.size:
        seq_plain = sequence[~np.isin(sequence, special_ids)]
        prompt_plain = prompt[~np.isin(prompt, special_ids)]
        if extends(prompt_plain, seq_plain):
            return failure(TEMPLATE, BY_SPECIAL_IDS, "the sequences differ only in special tokens")
        by = BY_SPECIAL_IDS
    else:
        by = BY_HEURISTIC
        if position < sequence.size and sequence.size - position <= _TEMPLATE_TAIL and position < prompt.size:
            return failure(
                TEMPLATE, by, "only the sequence's last tokens differ (a turn end rendered differently)"
            )
    if position < sequence.size and _realigns(sequence, prompt, position):
        return failure(RETOKENIZATION, by, "the sequences re-align shortly after differing (re-encoded text)")
    if prompt.size < sequence.size and position == prompt.size:
        return failure(OTHER, by, "the prompt is shorter than the sequence (context cut)")
    return failure(OTHER, by, f"the prompt differs from the sequence at token {position}")


def _realigns(sequence: np.ndarray, prompt: np.ndarray, position: int) -> bool:
    """Whether, within a short window after `position`, the rest of `sequence` reappears in `prompt`
    at a different offset (a few tokens spelled differently, then the same tokens again)."""
    for i in range(position + 1, min(sequence.size, position + _REALIGN_WINDOW) + 1):
        tail = sequence[i:]
        if tail.size == 0:
            return False
        for j in range(position + 1, min(prompt.size - tail.size, position + 2 * _REALIGN_WINDOW) + 1):
            if j != i and np.array_equal(prompt[j : j + tail.size], tail):
                return True
    return False
