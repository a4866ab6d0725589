"""agl trainer: OTLP traces in, rollout-normalized RL out."""

__version__ = "0.1.0"
