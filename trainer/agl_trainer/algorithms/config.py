"""Algorithm settings, validated when built: a bad value names its key and how to fix it.

The settings themselves, with their defaults and meanings, are `AlgorithmSettings` (settings.py,
torch-free: the config's `backend.algorithm` section); `AlgorithmConfig` is those settings checked
against the registries of estimators, losses and aggregations.
"""

from __future__ import annotations

import math

import msgspec

from agl_trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_UNITS, SMALL_GROUP_POLICIES
from agl_trainer.algorithms.aggregation import LOSS_AGGREGATIONS, NEEDS_CONSTANT
from agl_trainer.algorithms.kl import KL_ESTIMATORS
from agl_trainer.algorithms.policy_loss import POLICY_LOSSES, ClipConfig
from agl_trainer.algorithms.settings import AlgorithmSettings
from agl_trainer.algorithms.token_age import IMPORTANCE_RULES, IMPORTANCE_SCOPES


class AlgorithmConfigError(ValueError):
    """A setting that cannot work; the message names the key and the fix."""


class AlgorithmConfig(AlgorithmSettings, frozen=True, kw_only=True):
    """`backend.algorithm` (`AlgorithmSettings`) with its values checked."""

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise AlgorithmConfigError(f"algorithm.{key}: {message}")

        choices = {
            "advantage_estimator": list(ADVANTAGE_ESTIMATORS),
            "advantage_unit": list(ADVANTAGE_UNITS),
            "policy_loss": list(POLICY_LOSSES),
            "loss_agg_mode": list(LOSS_AGGREGATIONS),
            "kl_estimator": list(KL_ESTIMATORS),
            "small_group_policy": list(SMALL_GROUP_POLICIES),
            "importance_scope": list(IMPORTANCE_SCOPES),
            "importance_rule": list(IMPORTANCE_RULES),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                fail(key, f"{getattr(self, key)!r} is not one of {allowed}")
        if self.min_group_size < 2:
            fail(
                "min_group_size",
                f"{self.min_group_size}: a group baseline needs at least 2 rollouts; use 2 or more",
            )
        if self.loss_agg_mode in NEEDS_CONSTANT and not (
            self.loss_norm_constant and self.loss_norm_constant > 0
        ):
            fail(
                "loss_norm_constant",
                f"mode {self.loss_agg_mode!r} needs a positive constant, e.g. the max "
                "tokens a rollout may generate",
            )
        for key in ("clip_ratio_low", "clip_ratio_high"):
            if not 0 < getattr(self, key) < 10:
                fail(key, f"{getattr(self, key)} must be in (0, 10); 0.2 is the usual value")
        if self.clip_ratio_low >= 1:
            fail("clip_ratio_low", f"{self.clip_ratio_low} >= 1 lets the ratio reach 0; use a value below 1")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            fail(
                "dual_clip_c", f"{self.dual_clip_c} must be > 1 (3.0 is usual), or null to disable dual clip"
            )
        for key in ("kl_coef", "entropy_coef"):
            if getattr(self, key) < 0:
                fail(key, f"{getattr(self, key)} must be >= 0")
        if self.importance_cap <= 0:
            fail("importance_cap", f"{self.importance_cap} must be positive (2.0 is usual)")
        if self.importance_rule == "ratio_mask" and not 0 <= self.importance_floor < self.importance_cap:
            fail(
                "importance_floor",
                f"{self.importance_floor} must be in [0, importance_cap={self.importance_cap}) (0.5 is usual)",
            )
        temperature = self.loss_temperature
        if temperature is not None and not (
            isinstance(temperature, (int, float)) and 0 < temperature <= 100 and math.isfinite(temperature)
        ):
            fail(
                "loss_temperature",
                f"{temperature!r} must be in (0, 100]: the sampling temperature of the training rollouts "
                "(sampling.train.temperature), or null to follow it",
            )
        if self.bypass_old_logprobs and self.temperature != 1.0:
            fail(
                "bypass_old_logprobs",
                f"takes the engine's log-probs (the model's own, temperature 1) as PPO's old log-probs, but the "
                f"loss trains at temperature {self.temperature}; set backend.algorithm.loss_temperature: 1.0 "
                "or bypass_old_logprobs: false",
            )
        if not (isinstance(self.agreement_threshold, (int, float)) and 0 < self.agreement_threshold < float("inf")):
            fail(
                "agreement_threshold",
                f"{self.agreement_threshold!r} must be a positive number of nats (0.1 is usual: a 10% probability gap)",
            )

    @property
    def temperature(self) -> float:
        """The loss's temperature (loss_temperature; 1.0 where unset: the run resolves null to
        sampling.train.temperature before building the backend, run/settings.py)."""
        return 1.0 if self.loss_temperature is None else float(self.loss_temperature)

    @property
    def clip(self) -> ClipConfig:
        return ClipConfig(low=self.clip_ratio_low, high=self.clip_ratio_high, dual_clip_c=self.dual_clip_c)

    @classmethod
    def from_dict(cls, values: dict) -> AlgorithmConfig:
        known = {field.name for field in msgspec.structs.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise AlgorithmConfigError(f"algorithm: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**values)
