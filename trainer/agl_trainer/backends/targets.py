"""Which positions of a micro-batch are scored: token t is predicted by the logits at t - 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Targets:
    """K scored tokens of a micro-batch: token (rows[k], positions[k] + 1), read from the logits at
    (rows[k], positions[k])."""

    rows: torch.Tensor  # [K]
    positions: torch.Tensor  # [K] logit positions

    def select(self, per_position: torch.Tensor) -> torch.Tensor:
        """[rows, width] -> [K] values at the scored tokens."""
        return per_position[self.rows, self.positions + 1]

    def scatter(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[K] -> [rows, width], zero where nothing is scored."""
        out = torch.zeros(shape, dtype=values.dtype)
        out[self.rows, self.positions + 1] = values
        return out


def trained_targets(trained: torch.Tensor) -> Targets | None:
    """Targets at the trained positions t >= 1 of a [rows, width] mask; None when there are none."""
    trained = trained.clone()
    trained[:, 0] = False  # nothing predicts a row's first token
    rows, columns = torch.nonzero(trained, as_tuple=True)
    if rows.numel() == 0:
        return None
    return Targets(rows=rows, positions=columns - 1)
