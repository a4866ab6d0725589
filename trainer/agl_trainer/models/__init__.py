"""Tiny models for CPU machines: `tiny` builds them offline (word-level or byte-level BPE tokenizer,
random Llama/Qwen2 weights, saved by path); `sampling` samples batches from them in-process."""
