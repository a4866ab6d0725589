"""Simulated device time (`engine.options.device_step_ms` of either engine): each engine step also
waits this long, as a host waits on an accelerator, so CPU benches show what a GPU's batch-independent
decode step costs. Its bound and check, shared by both engines' options (import-free: reading a
config stays light)."""

from __future__ import annotations

MAX_DEVICE_STEP_MS = 10_000.0


def check_device_step_ms(milliseconds: float) -> float:
    """`milliseconds` if it is in [0, MAX_DEVICE_STEP_MS]; else a ValueError naming the key."""
    if not 0.0 <= milliseconds <= MAX_DEVICE_STEP_MS:
        raise ValueError(
            f"engine.options.device_step_ms: must be in [0, {MAX_DEVICE_STEP_MS:g}], got {milliseconds} "
            "(fix: 0 turns it off)"
        )
    return milliseconds
