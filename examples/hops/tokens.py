"""The hops conversations at the token level, and the samples assembly makes of a rollout's calls.

`HopsTokens(tokenizer).prompt(messages)` gives the ids the word-level chat template renders (with
the generation prompt), built by hand because the in-process player renders thousands of prompts a
step (tests check it against `apply_chat_template`). `samples(calls)` turns a rollout's calls
(prompt, completion) into training rows as agl's assembly does: a call whose prompt extends an
earlier call's full sequence continues that call's sample (first child) or branches with the shared
prefix as context (later children); any other call starts a sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class HopsTokens:
    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        from examples.hops.task import WORDS

        missing = [w for w in (*WORDS, "system", "user", "assistant", "tool") if w not in vocab]
        if missing:
            raise ValueError(
                f"HopsTokens: the tokenizer is not the hops model's word-level one (lacks {missing[:3]})"
            )
        self.vocab = vocab
        self.words = {i: w for w, i in vocab.items()}
        self.start = vocab["<|im_start|>"]
        self.end = tokenizer.eos_token_id
        self.special = set(tokenizer.all_special_ids)

    def render(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool = True) -> list[int]:
        v, ids = self.vocab, []
        for message in messages:
            ids += [self.start, v[message["role"]], *(v[w] for w in message["content"].split()), self.end]
        return [*ids, self.start, v["assistant"]] if generation_prompt else ids

    def text(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[t] for t in ids if t not in self.special)

    def finish_reason(self, ids: Sequence[int]) -> str:
        return "stop" if ids and ids[-1] == self.end else "length"

    def demonstration(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """A whole conversation with its assistant turns (content and end of turn) marked to learn."""
        ids, mask = [], []
        for message in messages:
            rendered = self.render([message], generation_prompt=False)
            learn = message["role"] == "assistant"
            ids += rendered
            mask += [0, 0] + [int(learn)] * (len(rendered) - 2)
        return ids, mask


@dataclass
class Call:
    thread: str
    prompt: list[int]
    completion: list[int]


def samples(calls: Sequence[Call]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per sample, as agl's assembly builds them from these calls in order."""
    built: list[tuple[list[int], list[int]]] = []
    full: list[list[int]] = []  # each call's prompt + completion
    sample_of: dict[int, int] = {}  # call -> the sample that ends with it
    continued: set[int] = set()
    for index, call in enumerate(calls):
        parents = [
            j
            for j in range(index)
            if len(full[j]) <= len(call.prompt) and call.prompt[: len(full[j])] == full[j]
        ]
        parent = max(parents, key=lambda j: len(full[j])) if parents else None
        if parent is not None and parent not in continued:
            continued.add(parent)
            sample = sample_of.pop(parent)
            ids, mask = built[sample]
            mask = mask + [0] * (len(call.prompt) - len(ids)) + [1] * len(call.completion)
            built[sample] = ([*call.prompt, *call.completion], mask)
        else:
            sample = len(built)
            built.append(
                ([*call.prompt, *call.completion], [0] * len(call.prompt) + [1] * len(call.completion))
            )
        sample_of[index] = sample
        full.append([*call.prompt, *call.completion])
    return [(ids, mask) for ids, mask in built if any(mask)]
