"""Runnable example tasks and harnesses (importable from the repository root)."""
