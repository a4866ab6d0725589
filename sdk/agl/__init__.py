"""agl: reinforcement learning for agents, inside the harness they already run in.

The SDK is three calls: `agl.init()` (optional), `with agl.rollout(...)`, `agl.emit_reward(value)`.
It is safe inside someone else's process: it imports no torch or litellm, loads OpenTelemetry only
when a span is made, and never installs a global TracerProvider.
"""

from agl._tracing import flush, init
from agl.reward import NoRolloutError, emit_reward
from agl._version import __version__
from agl.rollout import Rollout, current_rollout, rollout

__all__ = [
    "NoRolloutError",
    "Rollout",
    "__version__",
    "current_rollout",
    "emit_reward",
    "flush",
    "init",
    "rollout",
]
