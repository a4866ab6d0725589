"""Following generation for the embedded engine: the text of a sequence as vLLM shows it, its new
tokens as they arrive, and the one server-sent-events loop both streaming routes share.

The scheduler thread reports `(sequence, token count, finished)` updates; `deliver` puts them on
the asyncio queue of the request that owns the sequence (its `sink`), where a handler reads them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec

from agl_trainer.engines.embedded import wire
from agl_trainer.engines.embedded.batching import Sequence
from agl_trainer.engines.embedded.wire import RequestError

SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
_json = msgspec.json.Encoder()

Update = tuple[Sequence, int, bool]
# Builds one streamed choice from (choice index, sequence, token position, text delta, last?).
ChoiceBuilder = Callable[[int, Sequence, int, str, bool], dict[str, Any]]


def deliver(updates: list[Update]) -> None:
    """On the event loop: hand each update to the queue of the request that owns its sequence."""
    for update in updates:
        update[0].sink.put_nowait(update)


def visible_text(tokenizer: Any, sequence: Sequence, count: int | None = None) -> str:
    """The text of the first `count` tokens as vLLM shows it: without a stop token, cut before a
    stop string, and (until the end) holding back incomplete UTF-8 and a possible stop prefix."""
    count = len(sequence.token_ids) if count is None else count
    final = sequence.finished and count >= len(sequence.token_ids)
    if final and sequence.stop_text is not None:
        return sequence.stop_text
    stopped_on_token = final and isinstance(sequence.stop_reason, int)
    ids = sequence.token_ids[: count - 1 if stopped_on_token else count]
    text = tokenizer.decode(ids, skip_special_tokens=sequence.params.skip_special_tokens)
    if not final or stopped_on_token:
        text = text.rstrip("\ufffd")  # incomplete UTF-8 waits for its next bytes
    if not final and sequence.params.stop:
        hold = max(len(s) for s in sequence.params.stop) - 1
        text = text[: max(0, len(text) - hold)]
    return text


def raise_if_failed(sequence: Sequence) -> None:
    if sequence.finish_reason == "error":
        raise RequestError(
            f"generation failed: {sequence.stop_reason}", code=500, type="InternalServerError"
        )


class cancel_on_exit:
    """Cancel the sequences still generating when the handler ends early (the client went away)."""

    def __init__(self, sequences: list[Sequence]) -> None:
        self.sequences = sequences

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for sequence in self.sequences:
            if not sequence.finished:
                sequence.cancelled = True


async def wait_all(sequences: list[Sequence], queue: asyncio.Queue[Any]) -> None:
    while not all(s.finished for s in sequences):
        await queue.get()


async def deltas(
    tokenizer: Any, sequences: list[Sequence], queue: asyncio.Queue[Any]
) -> AsyncIterator[tuple[int, Sequence, int, str, bool]]:
    """Each new token of a stream as (choice index, sequence, position, text delta, last?), in
    the order the scheduler produced them; stops early when a sequence failed."""
    index_of = {id(s): i for i, s in enumerate(sequences)}
    sent = [0] * len(sequences)
    shown = [""] * len(sequences)
    while any(sent[i] < len(s.token_ids) or not s.finished for i, s in enumerate(sequences)):
        sequence, count, _ = await queue.get()
        index = index_of[id(sequence)]
        if sequence.finish_reason == "error":
            return
        for position in range(sent[index], count):
            done = sequence.finished and position + 1 == len(sequence.token_ids)
            text = visible_text(tokenizer, sequence, position + 1)
            # Detokenizing a prefix can shorten the text (a byte-level token completes later):
            # what was shown stays shown.
            delta, shown[index] = (
                text[len(shown[index]) :],
                text if len(text) >= len(shown[index]) else shown[index],
            )
            yield index, sequence, position, delta, done
        sent[index] = max(sent[index], count)


async def stream_choices(
    request: Any,
    head: dict[str, Any],
    tokenizer: Any,
    sequences: list[Sequence],
    queue: asyncio.Queue[Any],
    choice_of: ChoiceBuilder,
    prompt_tokens: int,
    include_usage: bool,
    count_tokens: Callable[[int], None],
    preludes: Iterable[dict[str, Any]] = (),
) -> Any:
    """One streamed response, chat or completions alike: the `preludes` chunks, one chunk per new
    token (built by `choice_of`; the last one carries the fingerprint unless a usage chunk
    follows), the usage chunk when asked for, then `[DONE]`. `count_tokens` gets the number of
    generated tokens once generation ends."""
    from aiohttp import web

    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    response.enable_chunked_encoding()
    await response.prepare(request)
    try:
        for prelude in preludes:
            await send(response, {**head, **prelude})
        async for index, sequence, position, delta, done in deltas(tokenizer, sequences, queue):
            chunk = {**head, "choices": [choice_of(index, sequence, position, delta, done)]}
            if done and not include_usage:
                chunk["system_fingerprint"] = wire.SYSTEM_FINGERPRINT
            await send(response, chunk)
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        count_tokens(completion_tokens)
        if include_usage:
            await send(
                response,
                {
                    **head,
                    "choices": [],
                    "usage": wire.usage(prompt_tokens, completion_tokens, details=False),
                    "system_fingerprint": wire.SYSTEM_FINGERPRINT,
                },
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client hung up: nobody to answer (the caller cancels the rest)
        pass
    return response


async def send(response: Any, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + _json.encode(chunk) + b"\n\n")
