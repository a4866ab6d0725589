"""One `agl eval`: the parts training starts (run/serving.py: receiver, store, viewer, engine or a
served model, sidecar, runner), k attempts a task through them, then results.json and receipt.json.

Attempts are reproducible: rollout ids are `eval-{task index}-{attempt}` (the same in every run) and
the sidecar seeds every call from config.seed, the rollout and the request's bytes
(agl_sidecar.proxy.request.call_seed), so a harness that sends the same calls gets the same samples
whatever the concurrency. The store (OUTPUT_DIR/rollouts.db) opens in `agl traces serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl import semconv

from agl_trainer.config import Config, ConfigError, dump_config, read_tasks
from agl_trainer.eval.receipt import ENV_CONTEXT_TOKENS, ENV_MAX_TURNS, build_receipt, now_iso, write_result
from agl_trainer.eval.scores import TaskScore, summarize
from agl_trainer.loop.validation import SETTLE_TIMEOUT_S
from agl_trainer.models.hf_progress import quiet_progress
from agl_trainer.runners.base import RolloutSpec

EVAL_DROP_REASON = "evaluation"  # the store records that these rollouts are never to be trained


def eval_harness_env(config: Config) -> dict[str, str]:
    """What an evaluation adds to its harnesses' environment: its budgets, and a run id of its own
    (its rollout ids are the same in every evaluation: two at once on a machine must not share what a
    rollout keeps on disk)."""
    env = {semconv.ENV_RUN_ID: f"eval-{secrets.token_hex(3)}"}
    if config.eval.max_turns:
        env[ENV_MAX_TURNS] = str(config.eval.max_turns)
    if config.eval.context_tokens:
        env[ENV_CONTEXT_TOKENS] = str(config.eval.context_tokens)
    return env


@dataclass
class EvalResult:
    output_dir: Path
    receipt_path: Path
    summary: dict[str, float]
    tasks: list[dict[str, Any]]
    seconds: float
    rollouts: int


def eval_tasks_path(config: Config) -> str:
    path = config.eval.tasks or config.val_tasks or config.tasks
    if path is None:
        raise ConfigError("config key eval.tasks: missing (fix: a JSONL file of tasks, or set val_tasks or tasks)")
    if not Path(path).is_file():
        key = "eval.tasks" if config.eval.tasks else ("val_tasks" if config.val_tasks else "tasks")
        raise ConfigError(f"config key {key}: {path} does not exist (fix: point it at a JSONL file of tasks)")
    return path


def check_eval_config(config: Config) -> None:
    """What `agl eval` needs beyond the types: a harness, tasks, a model, a new output directory."""
    from agl_trainer.config import check_config

    eval_tasks_path(config)
    url = config.eval.model_url
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"config key eval.model_url: {url!r} is not an http(s) URL (fix: http://host:8000/v1)")
    import msgspec

    # check_config's training checks, minus what evaluation does not use (train tasks, validation)
    probe = msgspec.structs.replace(
        config,
        tasks=config.tasks if config.tasks and Path(config.tasks).is_file() else eval_tasks_path(config),
        val_tasks=None,
        loop=msgspec.structs.replace(config.loop, val_every=0),
    )
    if url is not None and (config.model.path is None or not Path(config.model.path).exists()):
        probe = msgspec.structs.replace(probe, model=msgspec.structs.replace(probe.model, path="."))
    check_config(probe, base=Path.cwd())
    out = Path(config.eval.output_dir)
    if (out / "rollouts.db").exists() or (out / "receipt.json").exists():
        raise ConfigError(
            f"config key eval.output_dir: {out} already holds an evaluation (fix: another directory; results "
            "are never overwritten)"
        )


def served_upstream(url: str) -> str:
    """The sidecar's upstream for an OpenAI base URL: without the trailing /v1 (it adds the paths)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def run_eval(config: Config, *, quiet: bool = False) -> EvalResult:
    check_eval_config(config)
    out = Path(config.eval.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(config))
    tasks_path = eval_tasks_path(config)
    tasks = read_tasks(tasks_path)
    from agl_trainer.metrics.trackers import start_trackers

    trackers = start_trackers(config, out, kind="eval")  # one that cannot start fails before the engine
    started_at, started = now_iso(), time.monotonic()
    try:
        # the evaluation reports its own progress: transformers' bars ("Loading weights" at the engine's
        # load) are off for its length, as for a training run
        with quiet_progress():
            return await _evaluate(config, out, tasks, tasks_path, trackers, started_at, started, quiet=quiet)
    finally:
        trackers.close()


async def _evaluate(
    config: Config, out: Path, tasks: list[dict[str, Any]], tasks_path: str, trackers: Any, started_at: str,
    started: float, *, quiet: bool,
) -> EvalResult:  # fmt: skip
    from agl_trainer.run import topology as addresses
    from agl_trainer.run.serving import start_serving
    from agl_trainer.loop.inflight import NO_DATA_AFTER_EXIT_S
    from agl_trainer.loop.validation import collect

    served = config.eval.model_url
    model_path = None if served else str(config.model.path)
    k, mode = config.eval.k, config.eval.mode
    topology = addresses.resolve(config)
    addresses.save_secrets(out, topology)
    async with contextlib.AsyncExitStack() as stack:
        serving = await start_serving(
            config, out, stack, model_path, topology=topology, served_url=served_upstream(served) if served else None,
            sidecar_seed=config.seed, harness_env=eval_harness_env(config),
        )  # fmt: skip
        specs = [
            RolloutSpec(f"eval-{index:05d}-{attempt}", str(task["id"]), task, 0, mode)
            for index, task in enumerate(tasks)
            for attempt in range(k)
        ]
        if not quiet:
            print(f"agl eval: {len(tasks)} tasks x {k} attempts ({mode} sampling) -> {out}", flush=True)
        no_data_timeout_s = NO_DATA_AFTER_EXIT_S + config.loop.completion_grace_s
        launched = time.monotonic()
        ready: list[float] = []
        outcomes, by_id = await collect(
            specs, serving.runner, serving.data, no_data_timeout_s, settle=lambda: serving.admin.flush(SETTLE_TIMEOUT_S),
            on_ready=lambda: ready.append(time.monotonic()),
        )  # fmt: skip
        rollout_s = (ready[0] if ready else time.monotonic()) - launched
        from agl_trainer.store import RolloutKey

        serving.data.mark_dropped([RolloutKey(o.spec.rollout_id, o.spec.attempt) for o in outcomes], EVAL_DROP_REASON)
    seconds = time.monotonic() - started
    ended_at = now_iso()
    scores: dict[str, TaskScore] = {}
    for spec in specs:
        scores.setdefault(spec.task_id, TaskScore(spec.task_id, [])).rewards.append(by_id.get(spec.rollout_id))
    summary, rows = summarize(list(scores.values()), config.eval.pass_reward, k)
    summary["seconds"] = seconds  # start-up included
    summary["rollout_seconds"] = rollout_s  # the attempts alone: launch to the last one's data stored
    summary["rollouts_per_s"] = len(specs) / rollout_s if rollout_s > 0 else 0.0
    results = {
        "summary": summary,
        "tasks": rows,
        "rollouts": [
            {"rollout_id": o.spec.rollout_id, "task_id": o.spec.task_id, "reward": by_id.get(o.spec.rollout_id),
             "cause": o.cause.value}
            for o in outcomes
        ],
    }  # fmt: skip
    receipt = build_receipt(
        config, kind="eval", model_path=model_path, served_url=served, tasks_path=tasks_path, k=k, mode=mode,
        seed=config.seed, started_at=started_at, ended_at=ended_at, results=results,
    )  # fmt: skip
    receipt_path = write_result(out, results, receipt)
    trackers.summary({f"eval/{key}": value for key, value in summary.items()}, [out / "results.json", receipt_path])
    return EvalResult(out, receipt_path, summary, rows, rollout_s, len(specs))


def run_eval_sync(config: Config, *, quiet: bool = False) -> EvalResult:
    return asyncio.run(run_eval(config, quiet=quiet))
