"""Policy weights between the trainer and the engines: what a sync carries (update.py), peft's
adapter files (peft_files.py), an adapter merged into base weights (merge.py), a tied output head
untied and tied back (tied_head.py), safetensors in and out (files.py).

Backends (which produce weights) and engines (which load them) both import this layer; it imports
neither of them (tests/test_architecture.py).
"""
