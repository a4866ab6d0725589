"""The sidecar application: the routes (routes/) mounted, the shared state (sidecar.py) started and closed with it.

Routes (each model route also under /rollouts/{rollout_id}/ and /rollouts/{rollout_id}/attempts/{n}/):
  POST /v1/chat/completions, /v1/completions; GET /v1/models; POST /v1/<adapter path> (translated);
  GET /v1/responses with Upgrade: websocket (the Responses WebSocket transport)
  POST /rollouts/{rollout_id}/reward, /rollouts/{rollout_id}/end
  /agl/v1/pause, /agl/v1/resume, /agl/v1/state, /agl/v1/flush (admin); /healthz; /metrics
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.protocols.registry import ADAPTERS
from agl_sidecar.routes.admin import admin_only, flush, healthz, metrics, pause, resume, state
from agl_sidecar.routes.common import no_route
from agl_sidecar.routes.harness import end_rollout, reward
from agl_sidecar.routes.model import chat, completions, models, translated
from agl_sidecar.routes.responses_ws import responses_ws
from agl_sidecar.sidecar import SIDECAR_KEY, Sidecar

_ROLLOUT = semconv.ROLLOUT_PATH_PREFIX + "/{rollout_id}"
_ATTEMPT = _ROLLOUT + semconv.ATTEMPT_PATH_PREFIX + "/{attempt:\\d+}"
_MODE = semconv.MODE_PATH_PREFIX + "/{mode}"  # the rollout's mode (train | val), checked in identity_from
ROLLOUT_PREFIXES = ("", _ROLLOUT, _ATTEMPT, _ROLLOUT + _MODE, _ATTEMPT + _MODE)


def build_app(config: SidecarConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    sidecar = Sidecar(config)
    app[SIDECAR_KEY] = sidecar
    for prefix in ROLLOUT_PREFIXES:
        app.router.add_post(prefix + "/v1/chat/completions", chat)
        app.router.add_post(prefix + "/v1/completions", completions)
        app.router.add_get(prefix + "/v1/models", models)
        for path in ADAPTERS:
            app.router.add_post(prefix + "/v1" + path, translated(path))
        app.router.add_get(prefix + "/v1/responses", responses_ws)  # the Responses WebSocket transport
        if prefix:
            app.router.add_post(prefix + semconv.REWARD_PATH, reward)
            app.router.add_post(prefix + semconv.END_PATH, end_rollout)
    app.router.add_post(semconv.ADMIN_PAUSE_PATH, admin_only(pause))
    app.router.add_post(semconv.ADMIN_RESUME_PATH, admin_only(resume))
    app.router.add_get(semconv.ADMIN_STATE_PATH, admin_only(state))
    app.router.add_post(semconv.ADMIN_FLUSH_PATH, admin_only(flush))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{path:.*}", no_route)  # last: a JSON 404 for whatever matched nothing

    async def lifecycle(app: web.Application) -> Any:
        await sidecar.start()
        yield
        await sidecar.close()

    app.cleanup_ctx.append(lifecycle)
    return app
