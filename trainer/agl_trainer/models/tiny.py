"""Tiny causal LMs built offline in milliseconds, saved where transformers and vLLM load them by path.

    from agl_trainer.models.tiny import TinyModelSpec, build_word_level_model, build_bpe_model

    build_word_level_model("runs/model", words=["call", "k0", "v0"], spec=TinyModelSpec(hidden=64))
    build_bpe_model("runs/bpe-model", spec=TinyModelSpec(hidden=128))

Both write a directory with `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja` and `generation_config.json`, and return its path.

- Word-level tokenizer (`build_word_level_tokenizer`): one token per whitespace-separated word,
  ChatML specials `<|im_start|>` (id 1) and `<|im_end|>` (id 2, EOS and pad), `<unk>` (id 0). Its
  chat template renders system/user/assistant/tool messages and assistant tool calls as
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`. Whitespace carries no token, so decoding an
  engine's output and rendering it again gives back the same tokens: the prompt of a second call
  extends the first call's prompt + completion exactly.
- Byte-level BPE tokenizer (`build_bpe_tokenizer`): trained in-process on a small built-in corpus
  (or yours), same specials plus `<|endoftext|>`, Qwen-style ChatML template; for generic text.
  `whole_lines=True` lets merges span words within a line: a large vocabulary trained on a long
  prompt that recurs (Codex's instructions, tests/harnesses) holds it in few tokens.
- Model: a random-init Llama or Qwen2 (`TinyModelSpec.architecture`): head_dim is 64 because
  vLLM's CPU attention rejects smaller heads; tied embeddings by default. The default is `llama`
  because transformers 5 forces `Qwen2Tokenizer` (a byte-level BPE) on every `model_type: qwen2`
  directory, whatever its tokenizer.json says, which would break a word-level vocabulary; Llama
  keeps the saved tokenizer. Qwen2 = Llama + q/k/v biases, so nothing else changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
ENDOFTEXT = "<|endoftext|>"
ROLES = ("system", "user", "assistant", "tool")
HEAD_DIM = 64  # vLLM's CPU attention rejects head sizes below 64
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}

# Renders tool calls as `call {name} {arguments}` so a word-level vocabulary can hold them.
WORD_LEVEL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %} call {{ call['function']['name'] }} "
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen-style ChatML with tool calls as <tool_call> JSON, for the byte-level tokenizer.
BPE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}\n<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-style ChatML for an agent harness: the tools listed in the system turn, the model's reasoning
# (`reasoning_content`) in <think></think> before its answer, tool calls as <tool_call> JSON, tool
# results as `tool` turns, `system` turns anywhere. Each part renders exactly as given (no stripping),
# so an answer parsed back into reasoning, content and tool calls renders to the same text again.
AGENT_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content if part['type'] == 'text' -%}"
    "{{ part['text'] }}{{ '\n' if not loop.last else '' }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set first = 0 -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{ text(messages[0]['content']) + '\n\n' }}"
    "{%- set first = 1 -%}{%- endif -%}"
    "{{ '# Tools\n<tools>' }}{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages[first:] -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') -%}"
    "{{ '<think>' + message['reasoning_content'] + '</think>' }}{%- endif -%}"
    "{{ text(message.get('content')) }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson -}}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

DEFAULT_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is 2 + 2? It is 4. "
    "A model answers questions, calls tools and reads their results. "
    "Reinforcement learning trains agents with rewards from their own attempts. "
    "system user assistant tool call result value key answer question hello world "
    "def main(): print('hello') return 0 if x > 1 else 1 # comment [1, 2, 3] {\"a\": 1} "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 ( ) [ ] { } < > = + - * / . , : ; ! ? ' \" \n"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random model. hidden must be a multiple of 64 (head_dim is fixed at 64)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 1
    kv_heads: int = 1
    intermediate: int = 256
    max_positions: int = 512
    tie_embeddings: bool = True
    seed: int = 0
    architecture: str = "llama"  # or "qwen2" (only with the byte-level tokenizer: see the module doc)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"TinyModelSpec: architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}"
            )
        if self.heads * HEAD_DIM != self.hidden:
            raise ValueError(
                f"TinyModelSpec: hidden ({self.hidden}) must equal heads ({self.heads}) x head_dim "
                f"({HEAD_DIM}); vLLM's CPU attention needs head_dim >= 64. Try hidden={self.heads * HEAD_DIM}."
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"TinyModelSpec: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )


def build_word_level_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerBase:
    """A tokenizer with one id per word: `<unk>`=0, `<|im_start|>`=1, `<|im_end|>`=2, the role names,
    then `words` in order (duplicates and the specials are skipped)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for word in (UNK, IM_START, IM_END, *ROLES, *words):
        if not word or any(ch.isspace() for ch in word):
            raise ValueError(f"build_word_level_tokenizer: word {word!r} is empty or holds whitespace")
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (UNK, IM_START, IM_END)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK, eos_token=IM_END, pad_token=IM_END, bos_token=None
    )
    tokenizer.chat_template = WORD_LEVEL_CHAT_TEMPLATE
    return tokenizer


def build_bpe_tokenizer(
    corpus: Sequence[str] | None = None,
    vocab_size: int = 384,
    chat_template: str | None = None,
    whole_lines: bool = False,
) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained in-process on `corpus` (default: a small built-in text),
    with `chat_template` (default BPE_CHAT_TEMPLATE; AGENT_CHAT_TEMPLATE for agent harnesses).

    `whole_lines`: merges may span words, up to a line's end (GPT-2's word split is off, tokens up to
    128 bytes), so a long prompt the corpus holds compresses to few tokens (Claude Code's 48k-character
    prompt: about 1,200 with a 16k vocabulary); a line still ends a token, so a prompt that ends in a
    newline tokenizes as the start of its continuation does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if whole_lines:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("\n"), "merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=128 if whole_lines else None,
    )
    backend.train_from_iterator(list(corpus) if corpus else [DEFAULT_CORPUS] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None, bos_token=None
    )
    tokenizer.chat_template = chat_template or BPE_CHAT_TEMPLATE
    return tokenizer


def build_model(
    vocab_size: int, spec: TinyModelSpec, eos_token_id: int, pad_token_id: int
) -> PreTrainedModel:
    """A random causal LM (`spec.architecture`) in float32, initialised from `spec.seed`."""
    import torch
    import transformers

    config_name, model_name = ARCHITECTURES[spec.architecture]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = getattr(transformers, model_name)(config)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model.eval()


def save_model(
    directory: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    spec: TinyModelSpec,
    manifest: dict | None = None,
) -> Path:
    """Build the model for `tokenizer` and save both to `directory` (created if missing)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(len(tokenizer), spec, tokenizer.eos_token_id, tokenizer.pad_token_id)
    from agl_trainer.models.hf_progress import quiet_progress

    with quiet_progress():  # a tiny model's one shard needs no progress bar
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "agl_tiny_model.json").write_text(
        json.dumps({"spec": asdict(spec), **(manifest or {})}, indent=1)
    )
    return path


def build_word_level_model(
    directory: str | Path, words: Iterable[str], spec: TinyModelSpec = TinyModelSpec()
) -> Path:
    """A tiny model with a word-level vocabulary (`words` plus specials and roles) in `directory`."""
    if spec.architecture == "qwen2":
        raise ValueError(
            "build_word_level_model: architecture 'qwen2' makes transformers load Qwen2Tokenizer and "
            "drop the word-level vocabulary; use architecture='llama' (the default)"
        )
    words = list(words)
    return save_model(
        directory, build_word_level_tokenizer(words), spec, {"tokenizer": "word-level", "words": words}
    )


def build_bpe_model(
    directory: str | Path,
    spec: TinyModelSpec = TinyModelSpec(hidden=128, heads=2, kv_heads=2),
    corpus: Sequence[str] | None = None,
    vocab_size: int = 384,
    whole_lines: bool = False,
    chat_template: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """A tiny model with an in-process-trained byte-level BPE tokenizer in `directory` (or the
    `tokenizer` given, already trained)."""
    if tokenizer is None:
        tokenizer = build_bpe_tokenizer(corpus, vocab_size, chat_template, whole_lines)
    return save_model(directory, tokenizer, spec, {"tokenizer": "byte-level-bpe"})
