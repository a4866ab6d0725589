"""`backend.verl.override`: verl config keys by dotted name, applied last to the configs agl builds.

The first part names the config: `model.` (verl's HFModelConfig: actor_rollout_ref.model.*),
`engine.` or `fsdp_config.` (FSDPEngineConfig: actor.fsdp_config.*), `optim.` (FSDPOptimizerConfig:
actor.optim.*), `checkpoint.`. Dict-valued fields take deeper keys (`engine.wrap_policy.min_num_params`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SECTIONS = {
    "model": "model",
    "engine": "engine",
    "fsdp_config": "engine",
    "optim": "optim",
    "checkpoint": "checkpoint",
}


def _section_classes() -> dict[str, type]:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    return {
        "model": HFModelConfig,
        "engine": FSDPEngineConfig,
        "optim": FSDPOptimizerConfig,
        "checkpoint": CheckpointConfig,
    }


def override_problem(key: str) -> str | None:
    """Why `key` cannot be applied, or None when it can."""
    parts = key.split(".")
    if len(parts) < 2 or parts[0] not in SECTIONS:
        return (
            f"{key!r} must start with one of {sorted(SECTIONS)} followed by a field (e.g. engine.wrap_policy)"
        )
    cls = _section_classes()[SECTIONS[parts[0]]]
    names = {f.name for f in dataclasses.fields(cls)}
    if parts[1] not in names:
        return f"{key!r}: {cls.__name__} has no field {parts[1]!r}"
    return None


def apply_overrides(configs: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        problem = override_problem(key)
        if problem is not None:
            raise ValueError(f"backend.verl.override: {problem}")
        section, field, *rest = key.split(".")
        target = configs[SECTIONS[section]]
        if not rest:
            object.__setattr__(target, field, value)  # verl's configs freeze some fields after init
            continue
        container = getattr(target, field)
        if container is None:
            container = {}
            object.__setattr__(target, field, container)
        for part in rest[:-1]:
            container = container.setdefault(part, {})
        container[rest[-1]] = value
