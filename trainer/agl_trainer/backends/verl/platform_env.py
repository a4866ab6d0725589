"""The environment that makes verl load agl's CPU platform (`platform.py`); no verl import here,
since it must be set before verl is imported."""

from __future__ import annotations

PLATFORM_MODULE = "agl_trainer.backends.verl.platform"
PLATFORM_NAME = "cpu"


def platform_env() -> dict[str, str]:
    """Set in every process (driver and Ray workers) before verl is imported."""
    return {
        "VERL_USE_EXTERNAL_MODULES": PLATFORM_MODULE,
        "VERL_PLATFORM": PLATFORM_NAME,
        "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda/npu; it runs on the platform's device
    }
