"""Rich progress bars: rollouts toward the next batch, and training steps with the latest reward."""

from __future__ import annotations

from typing import Any

from agl_trainer.console import make_console


class LoopProgress:
    """Two bars on stderr; `enabled=False` (tests, logs) makes every method a no-op."""

    def __init__(self, max_steps: int, batch_rollouts: int, *, enabled: bool = True, start_step: int = 0) -> None:
        self.enabled = enabled
        self._progress: Any = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description:<9}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=make_console(stderr=True),
            transient=False,
        )
        self._steps = self._progress.add_task("steps", total=max_steps, completed=start_step, info="")
        self._rollouts = self._progress.add_task("rollouts", total=batch_rollouts, info="")
        self._progress.start()

    def rollouts(self, ready: int, in_flight: int) -> None:
        if self._progress is not None:
            self._progress.update(self._rollouts, completed=ready, info=f"{in_flight} in flight")

    def step(self, step: int, reward: float | None, seconds: float) -> None:
        if self._progress is not None:
            info = f"reward {reward:.3f}  {seconds:.2f} s/step" if reward is not None else ""
            self._progress.update(self._steps, completed=step, info=info)

    def log(self, message: str) -> None:
        """Messages are shown even without bars: they explain failures."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            import sys

            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
