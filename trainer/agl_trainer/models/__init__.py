"""Tiny models for CPU machines: `tiny` builds them offline (word-level or byte-level BPE tokenizer,
random Llama/Qwen2 weights, saved by path) for the demo, the tests and the benches."""
