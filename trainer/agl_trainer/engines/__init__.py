"""Inference engines: `embedded` (a small transformers server for CPU machines) and `vllm`."""
