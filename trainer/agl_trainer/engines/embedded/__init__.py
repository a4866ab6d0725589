"""The embedded engine: a small batched transformers server with vLLM's wire format, for CPU
machines (engine.py, EmbeddedEngine). Importing the package imports nothing: wire.py is torch-free
and harness_check builds its bodies with it."""
