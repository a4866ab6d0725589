"""What the cluster says about this runner's Jobs and their pods: two watches plus a periodic list.

The official client is synchronous, so each watch runs in its own daemon thread and hands events to
the asyncio loop (`call_soon_threadsafe`); API calls go through the runner's thread pool. A watch
can miss events (a dropped connection, `410 Gone` after compaction), so the watch restarts from a
fresh list, and every `reconcile_s` the tracker lists Jobs and Pods anyway: a missed event delays a
rollout's end by at most one reconcile, never strands it. A Job missing from a list newer than its
creation was deleted from outside. While the API server is away the lists back off (kubernetes_retry):
the watches' relists without end, each wait at most backoff.max_s, the others for backoff.attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from agl_trainer.runners.kubernetes_manifest import LABEL_JOB
from agl_trainer.runners.kubernetes_retry import Backoff, call_with_backoff, describe
from agl_trainer.runners.kubernetes_status import job_finished

log = logging.getLogger(__name__)

JOBS, PODS = "jobs", "pods"


def _rv(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


def _at_least(a: str | None, b: str | None) -> bool:
    """resourceVersion a >= b. Versions are opaque strings by contract; every server issues etcd
    revisions (integers), and when they do not parse we take the newer report as newer."""
    if a is None or b is None:
        return True
    try:
        return int(a) >= int(b)
    except ValueError:
        return True


def _pod_done(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


@dataclass
class JobState:
    """The latest Job and pods the cluster reported for one rollout attempt."""

    name: str
    job: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    gone: bool = False  # deleted (or vanished) before it finished
    created_rv: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def update_job(self, job: dict[str, Any]) -> None:
        if self.job is not None:
            if job_finished(self.job) and not job_finished(job):
                return  # an older report arriving late
            if not _at_least(_rv(job), _rv(self.job)):
                return
        self.job = job
        self.changed.set()

    def update_pod(self, pod: dict[str, Any]) -> None:
        name = (pod.get("metadata") or {}).get("name", "")
        known = self.pods.get(name)
        if known is not None and ((_pod_done(known) and not _pod_done(pod)) or not _at_least(_rv(pod), _rv(known))):
            return
        self.pods[name] = pod
        self.changed.set()


def pod_job(pod: dict[str, Any]) -> str | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_JOB) or labels.get("batch.kubernetes.io/job-name") or labels.get("job-name")


class JobTracker:
    """Jobs and pods labelled with `selector`, kept current for the rollouts waiting on them."""

    def __init__(
        self,
        batch: Any,
        core: Any,
        namespace: str,
        selector: str,
        executor: Executor,
        *,
        reconcile_s: float = 15.0,
        watch_timeout_s: int = 60,
        backoff: Backoff | None = None,
    ) -> None:
        self.backoff = backoff or Backoff()
        self.batch, self.core = batch, core
        self.namespace, self.selector = namespace, selector
        self.executor = executor
        self.reconcile_s = reconcile_s
        self.watch_timeout_s = watch_timeout_s
        self.states: dict[str, JobState] = {}
        self.reconciles = 0  # lists applied (the periodic ones and the watches' restarts)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: dict[str, Any] = {}
        self._reconciler: asyncio.Task[None] | None = None

    # -- the loop side ------------------------------------------------------------------------

    def track(self, name: str) -> JobState:
        state = self.states.setdefault(name, JobState(name))
        return state

    def forget(self, name: str) -> None:
        self.states.pop(name, None)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        rvs = {kind: await self._call(self._list_sync, kind) for kind in (JOBS, PODS)}  # errors surface here
        for kind in (JOBS, PODS):
            thread = threading.Thread(
                target=self._watch_thread, args=(kind, rvs[kind][1]), name=f"agl-kube-watch-{kind}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._reconciler = asyncio.create_task(self._reconcile_forever())

    async def stop(self) -> None:
        self._stopping.set()
        for watch in list(self._watches.values()):
            with contextlib.suppress(Exception):
                watch.stop()
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciler
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 5.0)
        self._threads.clear()

    async def reconcile(self) -> None:
        """List Jobs and Pods now and apply what the watches may have missed."""
        for kind in (JOBS, PODS):
            items, rv = await self._call(self._list_sync, kind)
            self._apply_list(kind, items, rv)

    async def pods_of(self, name: str) -> list[dict[str, Any]]:
        """The Job's pods, listed now (a finished Job's pod may not have been reported yet)."""
        response = await self._call(
            self.core.list_namespaced_pod, self.namespace, label_selector=f"{LABEL_JOB}={name}"
        )
        pods = [self._plain(pod) for pod in response.items]
        state = self.states.get(name)
        if state is not None:
            for pod in pods:
                state.update_pod(pod)
            return list(state.pods.values())
        return pods

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_s)
            try:
                await self.reconcile()
            except Exception as error:  # the API server is away: the next round tries again
                log.warning("kubernetes reconcile failed: %s", error)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        host = str(self.batch.api_client.configuration.host)

        def report(error: BaseException, wait: float) -> None:
            log.warning("kubernetes list at %s: %s; trying again in %.1f s", host, describe(error), wait)

        return await call_with_backoff(
            lambda: loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs)), self.backoff, host, on_retry=report
        )

    def _apply(self, kind: str, kind_of_event: str, obj: dict[str, Any]) -> None:
        if kind == JOBS:
            state = self.states.get((obj.get("metadata") or {}).get("name", ""))
            if state is None:
                return
            if kind_of_event == "DELETED":
                if state.job is None or not job_finished(state.job):
                    state.gone = True
                state.changed.set()
            else:
                state.update_job(obj)
            return
        state = self.states.get(pod_job(obj) or "")
        if state is None:
            return
        if kind_of_event == "DELETED" and not _pod_done(obj):
            state.pods.pop((obj.get("metadata") or {}).get("name", ""), None)
            state.changed.set()
        else:
            state.update_pod(obj)

    def _apply_list(self, kind: str, items: list[dict[str, Any]], list_rv: str | None) -> None:
        self.reconciles += 1
        seen: set[str] = set()
        for obj in items:
            self._apply(kind, "MODIFIED", obj)
            seen.add(((obj.get("metadata") or {}).get("name", "")) if kind == JOBS else (pod_job(obj) or ""))
        if kind != JOBS:
            return
        for state in self.states.values():
            if state.name in seen or state.created_rv is None or state.gone:
                continue
            if _at_least(list_rv, state.created_rv) and not (state.job is not None and job_finished(state.job)):
                state.gone = True  # a list newer than the Job's creation does not hold it
                state.changed.set()

    # -- the thread side ----------------------------------------------------------------------

    def _list_fn(self, kind: str) -> Callable[..., Any]:
        return self.batch.list_namespaced_job if kind == JOBS else self.core.list_namespaced_pod

    def _list_sync(self, kind: str) -> tuple[list[dict[str, Any]], str | None]:
        response = self._list_fn(kind)(self.namespace, label_selector=self.selector)
        return [self._plain(item) for item in response.items], response.metadata.resource_version

    def _plain(self, model: Any) -> dict[str, Any]:
        return self.batch.api_client.sanitize_for_serialization(model)  # type: ignore[no-any-return]

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed while this thread was reading
            self._loop.call_soon_threadsafe(fn, *args)

    def _watch_thread(self, kind: str, rv: str | None) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        failures = 0  # in a row: the wait before the next relist grows with them, up to backoff.max_s
        while not self._stopping.is_set():
            stream = watch.Watch()
            self._watches[kind] = stream
            try:
                for event in stream.stream(
                    self._list_fn(kind),
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=rv,
                    timeout_seconds=self.watch_timeout_s,
                    allow_watch_bookmarks=True,
                ):
                    if self._stopping.is_set():
                        break
                    raw = event["raw_object"]
                    rv = _rv(raw) or rv
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._post(self._apply, kind, event["type"], raw)
                    failures = 0
                continue  # the server ended the watch (timeoutSeconds): resume from rv
            except ApiException as error:
                if self._stopping.is_set():
                    return
                if error.status != 410:
                    log.warning("kubernetes %s watch failed (%s): relisting", kind, describe(error))
                    self._stopping.wait(self.backoff.delay(min(failures, 16)))
                    failures += 1
            except Exception as error:  # connection dropped: relist and watch again
                if self._stopping.is_set():
                    return
                log.warning("kubernetes %s watch dropped (%s): relisting", kind, error)
                self._stopping.wait(self.backoff.delay(min(failures, 16)))
                failures += 1
            while not self._stopping.is_set():  # 410 Gone or an error: the list is the new start
                try:
                    items, rv = self._list_sync(kind)
                    self._post(self._apply_list, kind, items, rv)
                    break
                except Exception as error:
                    wait = self.backoff.delay(min(failures, 16))
                    failures += 1
                    log.warning("kubernetes %s list failed (%s): trying again in %.1f s", kind, describe(error), wait)
                    self._stopping.wait(wait)
