"""The stand-in vLLM lives in testing/agl_testing/fake_vllm.py (bench/ uses it too); this name stays
for the tests that still import it from here."""

from agl_testing.fake_vllm import FakeVLLM

__all__ = ["FakeVLLM"]
