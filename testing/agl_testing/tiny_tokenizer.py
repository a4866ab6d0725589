"""A real byte-level BPE tokenizer with ChatML special tokens, trained in-process (no hub)."""

from __future__ import annotations

import functools

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.cache
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["hello world, the tool says 42 and the answer is hello", "user assistant tool call result"] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


def encode(text: str) -> list[int]:
    return tiny_tokenizer().encode(text, add_special_tokens=False)


def special(token: str) -> int:
    return tiny_tokenizer().convert_tokens_to_ids(token)
