"""The demo task at the token level, for the warm start and the in-process reference.

`DemoTokens(tokenizer)` builds the exact ids the chat template gives the harness's messages
(tests check it against `apply_chat_template`), so what is trained in-process is what the
pipeline would record. `run_episodes` plays whole episodes with batched sampling in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from examples.demo import task as demo


class DemoTokens:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [w for w in (*demo.WORDS, "user", "assistant", "tool") if w not in vocab]
        if missing:
            raise ValueError(
                f"DemoTokens: the tokenizer is not the demo's word-level one (lacks {missing[:3]})"
            )
        self.vocab = vocab
        self.words = {i: w for w, i in vocab.items()}
        self.start = vocab["<|im_start|>"]
        self.end = tokenizer.eos_token_id
        self.special = set(tokenizer.all_special_ids)

    def prompt1(self, task: dict[str, Any]) -> list[int]:
        v = self.vocab
        return [self.start, v["user"], v[task["key"]], self.end, self.start, v["assistant"]]

    def prompt2(
        self, task: dict[str, Any], prompt1: list[int], call1: Sequence[int], tool_answer: str
    ) -> list[int]:
        """The second call's prompt as the template renders it after the engine's text of call 1."""
        v = self.vocab
        shown = [t for t in call1 if t not in self.special]  # the text the harness got back
        return [
            *prompt1,
            *shown,
            self.end,
            self.start,
            v["tool"],
            v[tool_answer],
            self.end,
            self.start,
            v["assistant"],
        ]

    def text(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[t] for t in ids if t not in self.special)

    def generated_words(self, ids: Sequence[int]) -> list[str]:
        stopped = bool(ids) and ids[-1] == self.end
        return demo.generated_words(self.text(ids), "stop" if stopped else "length")

    def demonstration(self, task: dict[str, Any]):
        """The ideal episode as one sequence with the 5 assistant positions marked."""
        from examples.demo.warmstart import Demonstration

        v = self.vocab
        p1 = self.prompt1(task)
        call1 = [v[demo.CALL], v[task["key"]], self.end]
        value = demo.expected_answer(task)[0]
        p2 = self.prompt2(task, p1, call1, value)
        ids = [*p2, v[value], self.end]
        mask = [0] * len(ids)
        for position in (*range(len(p1), len(p1) + 3), len(ids) - 2, len(ids) - 1):
            mask[position] = 1
        return Demonstration(ids, mask)


@dataclass
class Episode:
    task: dict[str, Any]
    prompt1: list[int]
    call1: list[int]
    prompt2: list[int]
    call2: list[int]
    reward: float


def run_episodes(
    model: Any,
    tokens: DemoTokens,
    tasks: Sequence[dict[str, Any]],
    *,
    temperature: float = 1.0,
    generator: Any = None,
) -> list[Episode]:
    """Play one episode per task (repeat tasks for groups), both calls batched across episodes."""
    from examples.demo.sampling import sample_batch

    eos = {tokens.end}
    prompts1 = [tokens.prompt1(t) for t in tasks]
    first = sample_batch(
        model,
        prompts1,
        demo.CALL1_MAX_TOKENS,
        eos_ids=eos,
        pad_id=tokens.end,
        temperature=temperature,
        generator=generator,
    )
    prompts2 = [
        tokens.prompt2(t, p, s.token_ids, demo.run_tool(t, tokens.text(s.token_ids)))
        for t, p, s in zip(tasks, prompts1, first)
    ]
    second = sample_batch(
        model,
        prompts2,
        demo.CALL2_MAX_TOKENS,
        eos_ids=eos,
        pad_id=tokens.end,
        temperature=temperature,
        generator=generator,
    )
    episodes = []
    for t, p1, s1, p2, s2 in zip(tasks, prompts1, first, prompts2, second):
        reward = demo.episode_reward(
            t, tokens.generated_words(s1.token_ids), tokens.generated_words(s2.token_ids)
        )
        episodes.append(Episode(t, p1, s1.token_ids, p2, s2.token_ids, reward))
    return episodes


def mean_reward(
    model: Any, tokens: DemoTokens, tasks: Sequence[dict[str, Any]], *, seed: int = 0, repeats: int = 4
) -> float:
    """Mean reward of sampled episodes (temperature 1) over `tasks`, each played `repeats` times."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    episodes = run_episodes(model, tokens, [t for t in tasks for _ in range(repeats)], generator=generator)
    return sum(e.reward for e in episodes) / len(episodes)
