"""The stand-in vLLM lives in agl_trainer/testing/fake_vllm.py (bench/ uses it too); this name stays
for the tests that still import it from here."""

from agl_trainer.testing.fake_vllm import FakeVLLM

__all__ = ["FakeVLLM"]
