"""The canary's questions to an engine, asked over its OpenAI-compatible API with vLLM's wire format
(`loop.ports.ProbeEngine`; loop/canary.py asks them, the loop itself makes no HTTP call).

- prompt_logprobs: each prompt's logprob of its tokens from the second on, under the engine's weights
  (vLLM's `prompt_logprobs` on /v1/completions; prompt logprobs do not read vLLM's prefix cache)
- generate: greedy tokens after each prefix and their logprobs (generation reads a cached prefix's KV)

The model asked is the policy the harness calls: with a LoRA run's vLLM, which lists the base and the
adapter (the card with a parent), the adapter. Blocking (httpx.Client): the loop asks in a thread.
"""

from __future__ import annotations

from typing import Any

TIMEOUT_S = 120.0


class HttpProbeEngine:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._model: str | None = None
        self._client: Any = None  # an httpx.Client, made at the first question

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        body = {"prompt": prompts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        choices = sorted(self._post(body)["choices"], key=lambda c: c["index"])
        out = []
        for prompt, choice in zip(prompts, choices, strict=True):
            scored = choice.get("prompt_logprobs")
            if not scored or len(scored) != len(prompt):
                raise RuntimeError("the answer holds no prompt_logprobs for every prompt token")
            out.append([float(scored[i][str(prompt[i])]["logprob"]) for i in range(1, len(prompt))])
        return out

    def generate(self, prefixes: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        body = {
            "prompt": prefixes,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        choices = sorted(self._post(body)["choices"], key=lambda c: c["index"])
        out = []
        for choice in choices:
            tokens = [int(t) for t in choice["token_ids"]]
            logprobs = [float(v) for v in choice["logprobs"]["token_logprobs"]]
            if len(tokens) != len(logprobs):
                raise RuntimeError("the answer's token_ids and logprobs differ in length")
            out.append((tokens, logprobs))
        if len(out) != len(prefixes):
            raise RuntimeError(f"the answer holds {len(out)} choices for {len(prefixes)} prompts")
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=TIMEOUT_S)
        if self._model is None:
            models = self._client.get(f"{self.url}/v1/models")
            models.raise_for_status()
            cards = models.json()["data"]
            # A LoRA run's vLLM lists the base and the adapter (the card with a parent): the policy is
            # the adapter, the name the harness calls
            adapters = [card for card in cards if card.get("parent")]
            self._model = str((adapters or cards)[0]["id"])
        answer = self._client.post(f"{self.url}/v1/completions", json={"model": self._model, **body})
        if answer.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {answer.status_code}: {answer.text[:300]}")
        return answer.json()
