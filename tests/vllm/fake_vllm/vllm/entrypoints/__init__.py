"""Test double: see fake_vllm/vllm/entrypoints/openai/api_server.py."""
