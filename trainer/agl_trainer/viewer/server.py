"""`ViewerServer`: the trace viewer's HTTP server (aiohttp, in its own thread and event loop).

Routes (all GET; the API answers JSON, errors as {"error": ...} with a 4xx status):
    /                     the single page (static/index.html), /static/<file> its JS and CSS
    /api/overview         store counts, indexing progress, reward and entropy curves
    /api/rollouts         the rollouts table: filters, sort, limit/offset (queries.Filters)
    /api/rollout?id=&attempt=   one rollout (detail.rollout), a page of it: calls_offset/calls_limit,
                          samples_offset/samples_limit, tokens_offset/tokens_limit (detail.Page)
API work runs in a bounded pool with a time budget per request (work.py): 503 when busy, 504 over
budget, and a request whose client left is stopped.
    /api/step?step=       one training step (detail.step)
Everything reads the store through a read-only connection; pages are plain HTML/CSS/JS shipped in
the package (no build step, no CDN), served with a CSP that allows only this origin's scripts.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from agl_trainer.addresses import is_loopback
from agl_trainer.assembly import AssemblyConfig
from agl_trainer.background_loop import BackgroundLoop
from agl_trainer.receiver.client_errors import quiet_client_errors
from agl_trainer.store import queries
from agl_trainer.store.records import RolloutKey
from agl_trainer.viewer import access, detail, work
from agl_trainer.viewer.indexer import Indexer
from agl_trainer.viewer.run_model import run_model
from agl_trainer.viewer.tokens import TokenDecoder, TokenizerError, load_tokenizer

log = logging.getLogger("agl.viewer")

STATIC = {"app.js": "text/javascript", "app.css": "text/css", "index.html": "text/html"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
    " connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
ENTROPY_KEYS = ("actor/entropy", "entropy", "policy/entropy")
MAX_PARAM = 4096


def metrics_curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per step from metrics.jsonl: the training row's reward and entropy, and the
    held-out rewards of the validation row at that step (its own row; step 0: before training)."""
    points: dict[int, dict[str, Any]] = {}
    for row in rows:
        point = points.setdefault(
            row["step"], {"step": row["step"], "reward": None, "entropy": None, "val_reward": None, "val_sampled": None}
        )
        if "reward/mean" in row:
            point["reward"] = row["reward/mean"]
            point["entropy"] = next((row[k] for k in ENTROPY_KEYS if k in row), None)
        point["val_reward"] = row.get("val/reward", point["val_reward"])
        point["val_sampled"] = row.get("val/sampled/reward", point["val_sampled"])
    return sorted(points.values(), key=lambda point: point["step"])


class ListenError(ValueError):
    """A --listen address that is not host:port."""


def parse_listen(value: str) -> tuple[str, int]:
    """'127.0.0.1:8500', '[::1]:8500', ':8500' (= 127.0.0.1:8500), '0.0.0.0:8500' -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ListenError(f"listen address must be HOST:PORT (e.g. 127.0.0.1:8500), got {value!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port_text)


def _json(body: Any, status: int = 200) -> web.Response:
    text = json.dumps(body, allow_nan=False, default=_default, separators=(",", ":"))
    return web.Response(text=text, status=status, content_type="application/json", headers=HEADERS)


def _default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return repr(value)


def _clean(value: Any) -> Any:
    """NaN and infinities (a harness can send them as rewards) as null: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class Viewer:
    """The application: the store, the tokenizer (loaded on first use), the indexer, the routes."""

    def __init__(
        self,
        store_path: Path,
        *,
        model: str | None = None,
        run_dir: Path | None = None,
        reward_name: str | None = None,
        index: bool = True,
        index_duty: float = 1.0,
        token: str | None = None,
        workers: int = 2,
        max_pending: int = 16,
        budget_s: float = 30.0,
    ) -> None:
        self.store_path = Path(store_path)
        self.token = token or None  # off loopback: required of every request (access.py)
        self.database = queries.Database(self.store_path)
        self.run_dir = run_dir if run_dir is not None else self.store_path.parent
        # without --model, the model of the run whose store this is (its config.yaml), if still there
        self.model_source = "given" if model else "the run's config.yaml"
        self.model = model or run_model(self.run_dir)
        self.config = AssemblyConfig(reward_name=reward_name) if reward_name else AssemblyConfig()
        self._decoder: TokenDecoder | None = None
        self._decoder_error: str | None = None
        self._decoder_lock = threading.Lock()
        self.indexer = Indexer(self.database, self.config, duty=index_duty) if index else None
        self.pool = work.Pool(workers, max_pending, budget_s)  # API work: bounded, budgeted, cancellable
        self.loopback_only = False  # set by ViewerServer when it listens on a loopback address

    def decoder(self) -> TokenDecoder:
        with self._decoder_lock:
            if self._decoder is None:
                tokenizer = None
                if self.model:
                    try:
                        tokenizer = load_tokenizer(self.model)
                    except TokenizerError as error:
                        self._decoder_error = str(error)
                        log.warning("agl viewer: %s; showing token ids", error)
                self._decoder = TokenDecoder(tokenizer)
            return self._decoder

    @property
    def tokenizer_error(self) -> str | None:
        return self._decoder_error

    def start(self) -> None:
        if self.indexer is not None:
            self.indexer.start()

    def close(self) -> None:
        if self.indexer is not None:
            self.indexer.stop()
        self.pool.close()
        self.database.close()

    # --- the application ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._access])
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/overview", self._api(self.overview))
        app.router.add_get("/api/rollouts", self._api(self.rollouts))
        app.router.add_get("/api/rollout", self._api(self.rollout))
        app.router.add_get("/api/step", self._api(self.step))
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return _json({"error": error.reason}, error.status)
        except queries.QueryError as error:
            return _json({"error": str(error)}, error.status)
        except Exception:  # noqa: BLE001 (a bug: logged, answered as JSON)
            log.exception("agl viewer: %s failed", request.path_qs[:200])
            return _json({"error": "internal error (see the server's log)"}, 500)

    @web.middleware
    async def _access(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """On a loopback address, only requests naming a loopback host: a web page elsewhere cannot
        read the store by pointing its own domain name at 127.0.0.1 (DNS rebinding). With a token,
        only requests that carry it (access.py)."""
        if self.loopback_only and not access.is_loopback_host_header(request.headers.get("Host", "")):
            raise queries.QueryError("this viewer answers only requests for a loopback host name", 403)
        if self.token is None:
            return await handler(request)
        offered = request.query.get(access.QUERY)
        if offered is not None:  # a browser's first visit: keep the token in a cookie, not the URL
            if not access.token_matches(offered, self.token):
                raise queries.QueryError("wrong viewer token", 401)
            rest = [(k, v) for k, v in request.query.items() if k != access.QUERY]
            response = web.Response(status=303, headers={**HEADERS, "Location": str(request.rel_url.with_query(rest))})
            response.set_cookie(access.COOKIE, self.token, httponly=True, samesite="Strict", path="/")
            return response
        given = access.bearer(request.headers.get("Authorization")) or request.cookies.get(access.COOKIE)
        if not access.token_matches(given, self.token):
            return _json(
                {"error": "this viewer needs its token: send 'Authorization: Bearer <token>', or open the page once"
                 " as /?token=<token> (the browser keeps it in a cookie)"},
                401,
            )  # fmt: skip
        return await handler(request)

    def _api(self, function: Callable[[dict[str, str], work.Ticket], Any]) -> Callable:
        async def handler(request: web.Request) -> web.Response:
            params: dict[str, str] = {}
            for name, value in request.query.items():
                if name in params:
                    raise queries.QueryError(f"parameter {name[:40]!r} given twice")
                if len(value) > MAX_PARAM:
                    raise queries.QueryError(f"parameter {name[:40]!r} is longer than {MAX_PARAM} characters")
                if "\x00" in value:
                    raise queries.QueryError(f"parameter {name[:40]!r} holds a NUL character")
                params[name] = value
            try:
                result = await self.pool.run(request, lambda ticket: function(params, ticket))
            except work.Busy as error:
                return _json({"error": str(error)}, 503)
            except TimeoutError:
                return _json(
                    {"error": f"this request took longer than the viewer's budget of {self.pool.budget_s:g} s and"
                     " was stopped (ask for a smaller page: calls_limit, samples_limit, tokens_limit)"},
                    504,
                )  # fmt: skip
            return _json(_clean(result))

        return handler

    async def _index(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise queries.QueryError("no such file", 404)
        return self._file(name)

    def _file(self, name: str) -> web.Response:
        body = resources.files("agl_trainer.viewer").joinpath("static", name).read_bytes()
        return web.Response(body=body, content_type=STATIC[name], charset="utf-8", headers=HEADERS)

    # --- the API ----------------------------------------------------------------------------------
    def overview(self, params: dict[str, str], ticket: work.Ticket | None = None) -> dict[str, Any]:
        with self.database.lock:
            counts = queries.overview(self.database.db)
            steps = queries.steps(self.database.db)
        metrics = detail.metrics_rows(self.run_dir)
        if metrics:
            curve = metrics_curve(metrics)
            source = "metrics.jsonl"
        else:
            with self.database.lock:
                rewards = queries.step_rewards(self.database.db, self.config.reward_name)
            curve = [{"step": r["step"], "reward": r["reward/mean"], "entropy": None} for r in rewards]
            source = "store"
        return {
            "store": str(self.store_path),
            "model": self.model,
            "model_source": self.model_source if self.model else None,
            "tokenizer_error": self._decoder_error,
            "reward_name": self.config.reward_name,
            "counts": counts,
            "steps": steps,
            "curve": curve,
            "curve_source": source,
            "indexing": None if self.indexer is None else self.indexer.progress(),
        }

    def rollouts(self, params: dict[str, str], ticket: work.Ticket | None = None) -> dict[str, Any]:
        filters = queries.Filters(params)
        order, limit, offset = queries.parse_page(params)
        with self.database.lock:
            rows, total = queries.page(self.database.db, filters, self.config.reward_name, order, limit, offset)
        for row in rows:
            kinds = row.pop("break_kinds", None)
            row["break_kinds"] = json.loads(kinds) if kinds else None
            row.pop("rowid", None)
        return {
            "rows": rows,
            "total": total,
            "limit": limit,
            "offset": offset,
            "indexing": None if self.indexer is None else self.indexer.progress(),
        }

    def rollout(self, params: dict[str, str], ticket: work.Ticket | None = None) -> dict[str, Any]:
        rollout_id = params.get("id")
        if not rollout_id:
            raise queries.QueryError("give the rollout's id: /api/rollout?id=ROLLOUT_ID[&attempt=N]")
        attempt_text = params.get("attempt")
        if attempt_text:
            attempt = queries._int("attempt", attempt_text, 0, 2**31)
        else:
            with self.database.lock:
                found = queries.attempts(self.database.db, rollout_id)
            if not found:
                raise queries.QueryError(f"no rollout {rollout_id!r}", 404)
            attempt = found[-1]
        return detail.rollout(
            self.database,
            RolloutKey(rollout_id, attempt),
            self.config,
            self.decoder(),
            self.run_dir,
            detail.Page.parse(params),
            ticket.check if ticket is not None else detail._never,
        )

    def step(self, params: dict[str, str], ticket: work.Ticket | None = None) -> dict[str, Any]:
        raw = params.get("step")
        if not raw:
            raise queries.QueryError("give the step: /api/step?step=N")
        return detail.step(self.database, queries._int("step", raw, 0, 2**62), self.config, self.run_dir)


class ViewerServer:
    """A `Viewer` served from a background thread: `start()` binds and returns; `url`; `stop()`."""

    def __init__(
        self,
        viewer: Viewer,
        listen: str = "127.0.0.1:8500",
        *,
        allow_no_token: bool = False,
        token_hint: str = "set a token (agl traces serve --token-env)",
    ) -> None:
        self.viewer = viewer
        self.host, self.port = parse_listen(listen)
        access.check_listen(self.host, viewer.token, allow_no_token, token_hint)
        viewer.loopback_only = is_loopback(self.host)
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._serving = BackgroundLoop("agl-viewer")

    def start(self) -> ViewerServer:
        if self._serving.started:  # already serving (e.g. `with serve(...) as server`)
            return self
        try:
            self._serving.start(self._bind, lambda: self._runner.cleanup())  # type: ignore[union-attr]
        except BaseException:
            self.viewer.close()
            raise
        self.viewer.start()
        return self

    async def _bind(self) -> None:
        quiet_client_errors()  # a browser's over-long URL is its 400, not a traceback in our log
        self._runner = web.AppRunner(self.viewer.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/"

    def stop(self) -> None:
        self._serving.stop(timeout_s=10)
        self.viewer.close()

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    store_path: str | Path,
    listen: str = "127.0.0.1:8500",
    *,
    model: str | None = None,
    run_dir: Path | None = None,
    reward_name: str | None = None,
) -> ViewerServer:
    """Start the viewer over `store_path` in a background thread; returns the running server."""
    viewer = Viewer(Path(store_path), model=model, run_dir=run_dir, reward_name=reward_name)
    return ViewerServer(viewer, listen).start()
