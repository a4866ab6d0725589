"""What `agl eval` adds to its harnesses' environment: its budgets, and a run id of its own."""

from __future__ import annotations

from types import SimpleNamespace

from agl import semconv
from agl_trainer.eval.receipt import ENV_CONTEXT_TOKENS, ENV_MAX_TURNS
from agl_trainer.run.evaluation import eval_harness_env


def test_each_evaluation_gives_its_harnesses_a_run_id_of_its_own() -> None:
    """Its rollout ids are the same in every evaluation (eval-{task}-{attempt}); the run id is what
    tells two evaluations on one machine apart (examples/swe keys each rollout's copy by both)."""
    config = SimpleNamespace(eval=SimpleNamespace(max_turns=5, context_tokens=None))
    first, second = eval_harness_env(config), eval_harness_env(config)  # type: ignore[arg-type]
    assert first[semconv.ENV_RUN_ID] != second[semconv.ENV_RUN_ID]
    assert first[semconv.ENV_RUN_ID].startswith("eval-")
    assert first[ENV_MAX_TURNS] == "5" and ENV_CONTEXT_TOKENS not in first
