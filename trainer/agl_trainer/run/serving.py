"""The parts that turn a harness into stored rollouts, started the same way for `agl train` and
`agl eval`: receiver + store, the trace viewer, the engine (or a model served elsewhere), the
sidecar(s), and the runner that starts the harness pointed at them.

    serving = await start_serving(config, out, stack, model_path, topology=topology)
    serving.runner.run(spec)   # one rollout;  serving.data: the store's data plane
    serving.engine             # None when `served_url` names a model served elsewhere

Every part is registered on `stack`, so they stop in reverse order of start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_trainer.config import Config
from agl_trainer.runners.base import Endpoint, RolloutOutcome, RolloutSpec


@dataclass
class Serving:
    store: Any  # RolloutStore
    store_path: Path
    data: Any  # StoreDataPlane
    engine: Any | None  # None: a model served elsewhere
    engine_urls: list[str]
    admin: Any  # SidecarAdmin | SidecarFleet
    endpoint: Endpoint
    runner: Any
    receiver_url: str


async def start_serving(
    config: Config,
    out: Path,
    stack: contextlib.AsyncExitStack,
    model_path: str | None,
    *,
    topology: Any,
    served_url: str | None = None,
    after_engine: Callable[[Any], Awaitable[None]] | None = None,
    sidecar_seed: int | None = None,
    harness_env: dict[str, str] | None = None,
) -> Serving:
    """Start receiver, store, viewer, engine (unless `served_url`), sidecars and runner, in that order.
    `after_engine(engine)` runs once the engine is up and before any harness can reach it (training
    loads checkpointed weights there); `sidecar_seed` seeds every call (sidecar sampling_seed);
    `harness_env` adds to harness.env."""
    from agl_trainer.run import topology as addresses
    from agl_trainer.run.dataplane import StoreDataPlane
    from agl_trainer.run.servers import start_receiver, start_sidecars
    from agl_trainer.store import RolloutStore

    store_path = out / "rollouts.db"
    receiver, receiver_url, _ = start_receiver(topology, store_path)
    stack.callback(receiver.stop)
    timeout = config.harness.timeout_s * (config.harness.retries + 1) + 60
    store = RolloutStore(store_path, grace_s=config.loop.completion_grace_s, rollout_timeout_s=timeout)
    stack.callback(store.close)
    if config.viewer.enabled:  # the trace viewer over this store (agl traces serve's pages)
        from agl_trainer.viewer.training import start_for_training

        viewer = start_for_training(store_path, config.viewer.listen, model_path, out, config.viewer.token_env)
        if viewer is not None:
            stack.callback(viewer.stop)
    data = StoreDataPlane(store, config.assembly)

    engine = None
    if served_url is None:
        from agl_trainer.run.build import build_engine

        engine = build_engine(config, str(model_path))
        await asyncio.to_thread(engine.start)
        stack.callback(engine.stop)
        engine_urls = list(engine.urls)
        if after_engine is not None:
            await after_engine(engine)
    else:
        engine_urls = [served_url]

    sidecars = await start_sidecars(topology, config, engine_urls, receiver_url, out, stack, seed=sidecar_seed)
    admin = sidecars.admin
    endpoint = sidecars.endpoint(receiver_url, {**config.harness.env, **(harness_env or {})})
    addresses.write_harness_env(out, endpoint.sidecar_url, topology, receiver_url)

    def on_exit(outcome: RolloutOutcome) -> None:
        from agl_trainer.store import RolloutKey

        spec = outcome.spec
        data.harness_exited(RolloutKey(spec.rollout_id, spec.attempt), outcome.exit_code, outcome.cause.value)

    async def reward_sink(spec: RolloutSpec, value: float) -> None:
        await admin.emit_reward(spec.rollout_id, value)

    from agl_trainer.run.build import build_runner

    runner = build_runner(config, endpoint, out, on_exit, reward_sink)
    await runner.start()
    stack.push_async_callback(runner.stop)
    return Serving(store, store_path, data, engine, engine_urls, admin, endpoint, runner, receiver_url)
