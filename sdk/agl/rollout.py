"""`agl.rollout()`: one run of the agent on one task, as an `agl.rollout` span.

Use it as a context manager (sync or async) or as a decorator. It puts the rollout's identity in
W3C baggage, so rewards and the sidecar's calls made inside it are attributed without extra
arguments, and gives harnesses that build their own HTTP client the base URL and headers to use.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import unicodedata
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, overload

from agl import semconv

F = TypeVar("F", bound=Callable[..., Any])

_current: contextvars.ContextVar[Rollout | None] = contextvars.ContextVar("agl_rollout", default=None)


def current_rollout() -> Rollout | None:
    """The innermost active `agl.rollout`, if any."""
    return _current.get()


class Rollout:
    """An active (or ready to enter) rollout. Reusable as a decorator: each call is a new rollout."""

    def __init__(
        self,
        rollout_id: str | None = None,
        task_id: str | None = None,
        attempt: int | None = None,
        mode: str | None = None,
    ) -> None:
        if rollout_id is not None and (not isinstance(rollout_id, str) or not rollout_id):
            raise ValueError("agl.rollout: rollout_id must be a non-empty string")
        if rollout_id is not None:
            _check_rollout_id(rollout_id, "agl.rollout: rollout_id")
        if task_id is not None and not isinstance(task_id, str):
            raise TypeError("agl.rollout: task_id must be a string")
        if task_id is not None:
            _check_text(task_id, "agl.rollout: task_id")
        if attempt is not None and (
            isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0
        ):
            raise ValueError(f"agl.rollout: attempt must be an int >= 0, got {attempt!r}")
        if mode is not None and mode not in semconv.MODES:
            raise ValueError(f"agl.rollout: mode must be one of {semconv.MODES}, got {mode!r}")
        self._given = (rollout_id, task_id, attempt, mode)
        self._reset()

    def _reset(self) -> None:
        rollout_id, task_id, attempt, mode = self._given
        env = os.environ
        self.rollout_id: str = rollout_id or env_text(semconv.ENV_ROLLOUT_ID, rollout=True) or uuid.uuid4().hex
        self.task_id: str | None = task_id or env_text(semconv.ENV_TASK_ID)
        self.attempt: int = attempt if attempt is not None else _env_int(semconv.ENV_ATTEMPT, 0)
        env_mode = env.get(semconv.ENV_MODE)
        if not mode and env_mode and env_mode not in semconv.MODES:
            raise ValueError(
                f"agl: environment variable {semconv.ENV_MODE}={_shown(env_mode)} must be one of {semconv.MODES}"
            )
        self.mode: str = mode or env_mode or semconv.MODE_TRAIN
        self._span: Any = None
        self._tokens: list[Any] = []

    # --- for harnesses that build their own client ---------------------------------------------
    def base_url(self, sidecar_url: str) -> str:
        """The sidecar URL with this rollout's prefix: `http://h:p` -> `http://h:p/rollouts/ID/v1`.

        A rollout not in mode train carries its mode (`.../modes/val/v1`), as the runners' URLs do:
        the path is all an unmodified harness passes on, and the sidecar picks the mode's sampling."""
        if not isinstance(sidecar_url, str) or not sidecar_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http(s) URL, got {sidecar_url!r}")
        base = sidecar_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        mode = None if self.mode == semconv.MODE_TRAIN else self.mode
        return base + semconv.rollout_path(self.rollout_id, self.attempt, mode)

    def headers(self) -> dict[str, str]:
        """Headers that attribute a call to this rollout: x-agl-*, traceparent and baggage."""
        from opentelemetry import context, trace
        from opentelemetry.baggage.propagation import W3CBaggagePropagator
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        headers = {
            semconv.HEADER_ROLLOUT_ID: self.rollout_id,
            semconv.HEADER_ATTEMPT: str(self.attempt),
            semconv.HEADER_MODE: self.mode,
        }
        if self.task_id is not None:
            headers[semconv.HEADER_TASK_ID] = self.task_id
        ctx = self._baggage_context(context.get_current())
        if self._span is not None:
            ctx = trace.set_span_in_context(self._span, ctx)
        TraceContextTextMapPropagator().inject(headers, ctx)
        W3CBaggagePropagator().inject(headers, ctx)
        return headers

    # --- context manager -----------------------------------------------------------------------
    def __enter__(self) -> Rollout:
        from opentelemetry import context, trace

        from agl._tracing import get_tracer

        if self._span is not None:
            raise RuntimeError("agl.rollout: this rollout is already active; create a new one")
        attributes: dict[str, Any] = {
            semconv.ROLLOUT_ID: self.rollout_id,
            semconv.ATTEMPT: self.attempt,
            semconv.ROLLOUT_MODE: self.mode,
        }
        if self.task_id is not None:
            attributes[semconv.TASK_ID] = self.task_id
        parent = _parent_context()
        self._span = get_tracer().start_span(semconv.SPAN_ROLLOUT, context=parent, attributes=attributes)
        ctx = self._baggage_context(trace.set_span_in_context(self._span, parent))
        self._tokens = [context.attach(ctx), _current.set(self)]
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        from opentelemetry import context
        from opentelemetry.trace import Status, StatusCode

        span, (ctx_token, var_token) = self._span, self._tokens
        _current.reset(var_token)
        context.detach(ctx_token)
        if exc is not None:
            span.set_attribute(semconv.ROLLOUT_STATUS, semconv.STATUS_FAILED)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        else:
            span.set_attribute(semconv.ROLLOUT_STATUS, semconv.STATUS_SUCCEEDED)
        span.end()
        self._span = None
        self._tokens = []

    async def __aenter__(self) -> Rollout:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    # --- decorator -----------------------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        given = self._given

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with Rollout(*given):
                    return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Rollout(*given):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _baggage_context(self, ctx: Any) -> Any:
        from opentelemetry import baggage

        ctx = baggage.set_baggage(semconv.BAGGAGE_ROLLOUT_ID, self.rollout_id, ctx)
        ctx = baggage.set_baggage(semconv.BAGGAGE_ATTEMPT, str(self.attempt), ctx)
        ctx = baggage.set_baggage(semconv.BAGGAGE_MODE, self.mode, ctx)
        if self.task_id is not None:
            ctx = baggage.set_baggage(semconv.BAGGAGE_TASK_ID, self.task_id, ctx)
        return ctx

    def __repr__(self) -> str:
        return f"Rollout(rollout_id={self.rollout_id!r}, task_id={self.task_id!r}, attempt={self.attempt})"


@overload
def rollout(fn: F, /) -> F: ...
@overload
def rollout(
    rollout_id: str | None = None,
    task_id: str | None = None,
    attempt: int | None = None,
    mode: str | None = None,
) -> Rollout: ...
def rollout(
    rollout_id: Any = None,
    task_id: str | None = None,
    attempt: int | None = None,
    mode: str | None = None,
) -> Any:
    """Start a rollout: `with agl.rollout(task_id="t1") as r:` or `@agl.rollout()` / `@agl.rollout`.

    Defaults come from the runner's environment (AGL_ROLLOUT_ID, AGL_TASK_ID, AGL_ATTEMPT,
    AGL_ROLLOUT_MODE); without them the id is a new random one, attempt 0 and mode "train".
    """
    if callable(rollout_id):  # bare @agl.rollout
        return Rollout()(rollout_id)
    return Rollout(rollout_id, task_id, attempt, mode)


def _parent_context() -> Any:
    """The current context; in a process with no active span, the TRACEPARENT a runner handed down."""
    from opentelemetry import context, trace

    ctx = context.get_current()
    if trace.get_current_span(ctx).get_span_context().is_valid:
        return ctx
    traceparent = os.environ.get(semconv.ENV_TRACEPARENT)
    if not traceparent:
        return ctx
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent}, ctx)


def _env_int(name: str, default: int) -> int:
    """A count from the environment (an attempt): an integer from 0 to 2^63 - 1, as every span int
    must be (a negative or larger one would cost the spans it went into at the receiver)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"agl: environment variable {name}={_shown(raw)} is not an integer") from None
    if not 0 <= value <= semconv.INT64_MAX:
        raise ValueError(f"agl: environment variable {name}={_shown(raw)} must be from 0 to {semconv.INT64_MAX}")
    return value


def env_text(name: str, rollout: bool = False) -> str | None:
    """An id from the environment, checked as one given in code (None when unset or empty)."""
    raw = os.environ.get(name)
    if not raw:
        return None
    what = f"agl: environment variable {name}"
    if rollout:
        _check_rollout_id(raw, what)
    else:
        _check_text(raw, what)
    return raw


def _check_text(value: str, what: str) -> None:
    """Text a span carries must be printable UTF-8: a lone surrogate (an undecodable byte in an
    environment variable or a file name) cannot be encoded and fails the export of the whole batch
    it is in (other rollouts' spans too); a control character is refused by the sidecar and the
    receiver."""
    if value.isascii() and value.isprintable():
        return
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        raise ValueError(f"{what} must be printable UTF-8 text, got {_shown(value)}")


def _check_rollout_id(value: str, what: str) -> None:
    _check_text(value, what)
    if "/" in value or value in (".", ".."):  # a path segment of the sidecar's rollout prefix
        raise ValueError(f"{what} must not contain '/' or be '.' or '..': {_shown(value)}")


def _shown(value: str) -> str:
    shown = value.encode("ascii", "backslashreplace").decode("ascii")
    return repr(shown[:64] + ("..." if len(shown) > 64 else ""))
