"""What every runner shares: the rollout it is asked to run, the outcome it reports, the environment.

A runner starts the harness once per rollout, pointed at the sidecar with the rollout's prefix
(`OPENAI_BASE_URL=http://sidecar/rollouts/{id}/v1`), so every model call is attributed to the
rollout without any change to the harness. It reports how the harness ended; it never judges the
rollout's data (the store and assembly do).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agl import semconv

from agl_trainer.store.records import Cause  # the store's vocabulary for a rollout's end

# A harness exiting with this code (EX_TEMPFAIL) says "infrastructure failure, retry me".
EXIT_INFRA_RETRY = 75


@dataclass(frozen=True)
class RolloutSpec:
    rollout_id: str
    task_id: str
    task: dict[str, Any]
    attempt: int = 0
    mode: str = semconv.MODE_TRAIN


@dataclass
class RolloutOutcome:
    spec: RolloutSpec
    cause: Cause
    exit_code: int | None = None
    seconds: float = 0.0
    attempts: int = 1
    reward: float | None = None  # from the grader or a function harness's return value
    message: str = ""
    log_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.cause is Cause.OK


# Called when a harness attempt ends (before any retry), e.g. to tell the store it exited.
ExitHook = Callable[[RolloutOutcome], Awaitable[None] | None]
# Called with a reward the runner obtained itself (grader output, function return value).
RewardSink = Callable[[RolloutSpec, float], Awaitable[None]]


class Runner(Protocol):
    async def start(self) -> None: ...

    async def run(self, spec: RolloutSpec) -> RolloutOutcome:
        """Run the harness for `spec` (retrying infrastructure failures) and say how it ended."""
        ...

    async def stop(self) -> None: ...


class HarnessNotFound(RuntimeError):
    """The harness program or function does not exist: no rollout can run."""


@dataclass
class Endpoint:
    """Where harnesses send model calls and spans."""

    sidecar_url: str
    otlp_endpoint: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Several sidecars (one per engine node): (harness URL, harness key) of each; a rollout sticks
    # to sidecar_for(rollout id). Empty: sidecar_url alone.
    sidecars: list[tuple[str, str | None]] = field(default_factory=list)

    def sidecar_for(self, rollout_id: str) -> tuple[str, str | None]:
        if not self.sidecars:
            return self.sidecar_url, None
        return self.sidecars[sidecar_index(rollout_id, len(self.sidecars))]

    def base_url(self, spec: RolloutSpec) -> str:
        """The OpenAI base URL of a rollout: the sidecar with the rollout prefix."""
        # The URL is all an unmodified harness passes on: it carries the mode, so the sidecar
        # applies that mode's sampling (sampling.val: greedy) to every call of the rollout.
        mode = spec.mode if spec.mode != semconv.MODE_TRAIN else None
        path = semconv.rollout_path(spec.rollout_id, spec.attempt, mode)
        return f"{self.sidecar_for(spec.rollout_id)[0].rstrip('/')}{path}"

    def environment(self, spec: RolloutSpec) -> dict[str, str]:
        """The variables a harness process gets (on top of the runner's own environment)."""
        base_url = self.base_url(spec)
        env = {
            semconv.ENV_OPENAI_BASE_URL: base_url,
            semconv.ENV_OPENAI_API_KEY: semconv.PLACEHOLDER_API_KEY,
            semconv.ENV_ANTHROPIC_BASE_URL: base_url.removesuffix("/v1"),
            semconv.ENV_ANTHROPIC_API_KEY: semconv.PLACEHOLDER_API_KEY,
            semconv.ENV_ROLLOUT_ID: spec.rollout_id,
            semconv.ENV_TASK_ID: spec.task_id,
            semconv.ENV_ATTEMPT: str(spec.attempt),
            semconv.ENV_MODE: spec.mode,
            semconv.ENV_TASK: json.dumps(spec.task, separators=(",", ":")),
        }
        key = self.sidecar_for(spec.rollout_id)[1]
        if key:
            env[semconv.ENV_OPENAI_API_KEY] = env[semconv.ENV_ANTHROPIC_API_KEY] = key
        if self.otlp_endpoint:
            env[semconv.ENV_OTLP_ENDPOINT] = self.otlp_endpoint
        env.update(self.extra_env)
        return env


def sidecar_index(rollout_id: str, count: int) -> int:
    """Which of `count` sidecars serves a rollout: stable across processes (rewards go there too)."""
    import zlib

    return zlib.crc32(rollout_id.encode("utf-8", "surrogatepass")) % count if count > 1 else 0


async def run_with_retries(
    attempt: Callable[[RolloutSpec], Awaitable[RolloutOutcome]],
    spec: RolloutSpec,
    retries: int,
    stopping: Callable[[], bool] = lambda: False,
) -> RolloutOutcome:
    """Run `attempt` for `spec`; after an infrastructure failure run it again as the next attempt
    (a new attempt number: the failed one may have partial data), at most `retries` more times."""
    attempts = 0
    while True:
        outcome = await attempt(replace(spec, attempt=spec.attempt + attempts))
        attempts += 1
        if outcome.cause is not Cause.INFRA_ERROR or attempts > retries or stopping():
            outcome.attempts = attempts
            return outcome


async def call_hook(hook: ExitHook | None, outcome: RolloutOutcome) -> None:
    if hook is None:
        return
    result = hook(outcome)
    if result is not None:
        await result
