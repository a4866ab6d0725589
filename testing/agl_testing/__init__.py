"""Stand-ins and fixtures that the tests and the benchmarks (bench/) share, so bench/ never imports tests/.

fake_vllm.py: the one stand-in vLLM (deterministic answers in vLLM 0.32's wire format, or scripted
bytes); captures.py: where the real vLLM captures are; wire.py: readers of those captures (streams,
tool calls); rollouts.py: rollouts written straight into a store; tiny_tokenizer.py: a real byte-level
BPE tokenizer trained in-process. Not used by the product itself.
"""
