"""Request validation for the embedded engine: a decoded request becomes prompt token ids and
`Sequence`s to generate, or a vLLM-style `RequestError` naming the field at fault."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agl_trainer.engines.embedded import wire
from agl_trainer.engines.embedded.batching import SamplingParams, Sequence
from agl_trainer.engines.embedded.wire import RequestError


class RequestReader:
    """Checks requests against one served model (its names, vocabulary, context length, template)."""

    def __init__(self, model: Any, tokenizer: Any, served_names: list[str], max_model_len: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.served_names = served_names
        self.max_model_len = max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    def model_name(self, model: str | None) -> str:
        if model is None:
            return self.served_names[0]
        if model not in self.served_names:
            raise RequestError(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.served_names)}.",
                code=404,
                type="NotFoundError",
                param="model",
            )
        return model

    def check_prompt(self, prompt_ids: list[int]) -> None:
        vocab = self.vocab_size
        for token in prompt_ids:
            if not 0 <= token < vocab:
                raise RequestError(f"Token id {token} is out of vocabulary")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {len(prompt_ids)} input tokens, which leaves no room for output tokens. Please "
                "reduce the length of the input prompt.",
                param="input_tokens",
            )
        if not prompt_ids:
            raise RequestError("The prompt is empty", param="prompt")

    def check_tokens(self, tokens: list[int]) -> None:
        vocab = self.vocab_size
        if any(not 0 <= token < vocab for token in tokens):
            raise RequestError("a token id is out of vocabulary", param="tokens")

    def sampling(
        self, req: wire.SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_len: int
    ) -> SamplingParams:
        if max_tokens is not None:
            if max_tokens < 1:
                raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
            if max_tokens > self.max_model_len:
                raise RequestError(
                    f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                    f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                    param="max_tokens",
                )
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < 0:
            raise RequestError(f"temperature must be non-negative, got {temperature}.", param="temperature")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        if req.n < 1:
            raise RequestError(f"n must be at least 1, got {req.n}.", param="n")
        if logprobs is not None and not 0 <= logprobs <= wire.MAX_LOGPROBS:
            raise RequestError(
                f"logprobs must be between 0 and {wire.MAX_LOGPROBS}, got {logprobs}.", param="logprobs"
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        vocab = self.vocab_size
        bias = []
        for key, value in (req.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise RequestError(
                    f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})",
                    param="logit_bias",
                )
            bias.append((int(key), max(-100.0, min(100.0, float(value)))))
        return SamplingParams(
            max_tokens=max_tokens or (self.max_model_len - prompt_len),
            temperature=temperature,
            top_p=top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=tuple(bias),
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final: bool,
        tools: Any,
        kwargs: Any,
    ) -> list[int]:
        """The chat template applied to `messages`, as token ids (no special tokens added again)."""
        for position, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise RequestError(
                    f"messages[{position}] has no string 'role'",
                    type="Bad Request",
                    param=f"body.messages.{position}.role",
                )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **(kwargs or {}),
            )
        except Exception as error:  # noqa: BLE001 (a template that cannot render them: the client's problem)
            raise RequestError(
                f"The chat template could not render these messages: {error}", param="messages"
            ) from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt as token ids: token ids as given, text tokenized with special tokens."""
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]


def sequences(
    prompt_ids: list[int], params: SamplingParams, n: int, stream: bool, queue: Any
) -> list[Sequence]:
    """The `n` choices of one prompt, each with its own seed, reporting to `queue`."""
    choices = []
    for choice in range(n):
        seed = params.seed if (params.seed is None or choice == 0) else choice_seed(params.seed, choice)
        choice_params = params if seed == params.seed else replace(params, seed=seed)
        choices.append(Sequence(list(prompt_ids), choice_params, stream=stream, sink=queue))
    return choices


def choice_seed(seed: int, choice: int) -> int:
    """Choice 0 uses the request's seed (so n=1 and n=2 share it); the others a derived one."""
    return (seed * 1_000_003 + choice * 7_919) % (2**63)
