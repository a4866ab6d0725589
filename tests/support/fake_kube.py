"""A stand-in Kubernetes API server: batch/v1 Jobs and core/v1 Pods (with watch) and core/v1 Events.

No API server can run here, so the Kubernetes runner's tests talk to this one over loopback with
the official client. It follows the API server's wire behaviour for what the runner uses:

- create Job: 201 with the stored object; 409 AlreadyExists; 422 Invalid (no name, no containers,
  restartPolicy not Never/OnFailure); 403 Forbidden when a Job count quota (`job_quota`) is full
- get / delete Job (404 NotFound as a Status); delete with propagationPolicy Background removes pods
- list Jobs / Pods with labelSelector: `{kind}List` with metadata.resourceVersion, items without kind
- watch (`?watch=true`): chunked JSON lines `{"type": ADDED|MODIFIED|DELETED, "object": ...}`; from
  `resourceVersion` it replays later changes; an older version than the compaction point gets an
  ERROR event with a 410 Expired Status (as the real server sends); `timeoutSeconds` ends the stream
- list Events with fieldSelector involvedObject.name (the Job controller's FailedCreate)

A Job controller and kubelet are simulated: each Job gets one pod that goes Pending -> Running ->
Succeeded/Failed, or gets stuck, per a scenario the test chooses (by default the task's
`"scenario"` field in the pod's AGL_TASK): succeed, fail:N, hold (runs until `finish`), exec (runs
the container's command here with the pod's environment, secrets resolved from `secrets`),
image_pull (ErrImagePull -> ImagePullBackOff), invalid_image, unschedulable, no_pod (a pod quota:
FailedCreate event), oom, evict. `silently()` changes objects without watch events (a missed event:
only a list sees it); `compact()` makes resuming watches get 410 Gone; `drop_watches()` cuts them.
`fail(n, status)` answers the next n matching requests with that status (a Status body, as the API
server and the load balancers before it answer 429/5xx; Retry-After when given), status 0 closes the
connection unanswered (a server restarting); then the server answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import ssl
import string
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import web

JOBS, PODS = "jobs", "pods"
GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # the server parses query booleans with Go's ParseBool


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details, "code": code,
    }  # fmt: skip


def _error(code: int, reason: str, message: str, **details: Any) -> web.Response:
    return web.json_response(_status(code, reason, message, **details), status=code)


def parse_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """Equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`, joined by commas."""
    terms: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in (text or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            terms.append(lambda labels, k=term[1:]: k not in labels)
        else:
            terms.append(lambda labels, k=term: k in labels)
    return lambda labels: all(term(labels) for term in terms)


def default_scenario(job: dict[str, Any]) -> str:
    container = job["spec"]["template"]["spec"]["containers"][0]
    for item in container.get("env") or []:
        if item.get("name") == "AGL_TASK":
            return str(json.loads(item["value"]).get("scenario", "succeed"))
    return "succeed"


@dataclass
class Fault:
    count: int  # requests still to fail
    status: int  # 0: close the connection without an answer
    retry_after: str | None = None
    method: str | None = None  # only requests of this method (GET, POST, DELETE)
    path: str | None = None  # only paths containing this


class _Watcher:
    def __init__(self, resource: str, namespace: str, selector: Callable[[dict[str, str]], bool]) -> None:
        self.resource, self.namespace, self.selector = resource, namespace, selector
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()


class FakeKube:
    def __init__(self, step_s: float = 0.01, ssl_context: ssl.SSLContext | None = None) -> None:
        self.step_s = step_s
        self.ssl_context = ssl_context  # serve https (as an API server does; in-cluster config expects it)
        self.authorizations: set[str] = set()  # the Authorization headers requests came with
        self.scenario: Callable[[dict[str, Any]], str] = default_scenario
        self.job_quota: int | None = None
        self.secrets: dict[str, dict[str, str]] = {}  # name -> data (the kubelet resolves env from them)
        self.logs: dict[str, str] = {}  # pod name -> what an `exec` pod's process wrote
        self.exec_env: dict[str, str] = {}  # the node's environment under a pod's own (PATH, PYTHONPATH)
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {JOBS: {}, PODS: {}}
        self.events_log: list[dict[str, Any]] = []  # core/v1 Events
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, resource, type, object)
        self.compacted = 0
        self.created: list[dict[str, Any]] = []  # every Job manifest as POSTed
        self.deleted: list[str] = []
        self.max_live = 0
        self.watch_requests = 0
        self.list_requests = 0
        self.faults: list[Fault] = []
        self.failed: list[tuple[str, str, int]] = []  # (method, path, status) of each request failed on purpose
        self._rv = itertools.count(1)
        self._last_rv = 0
        self._silent = False
        self._watchers: list[_Watcher] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    # -- lifecycle (the server runs on a loop of its own, in a thread) ------------------------

    def start(self) -> FakeKube:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start_app())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fake-kube", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    async def _start_app(self) -> None:
        app = web.Application(middlewares=[self._faulty])
        app.router.add_route("*", "/apis/batch/v1/namespaces/{ns}/jobs", self._jobs)
        app.router.add_route("*", "/apis/batch/v1/namespaces/{ns}/jobs/{name}", self._job)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/log", self._pod_log)
        app.router.add_get("/api/v1/namespaces/{ns}/events", self._events)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for task in list(self._tasks):
                task.cancel()
            for watcher in self._watchers:
                watcher.queue.put_nowait(None)
            assert self._runner is not None
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig naming this server (what `harness.kubernetes.kubeconfig` points at)."""
        import yaml

        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}],
        }))  # fmt: skip
        return path

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on the server's loop (state changes from the test thread)."""
        assert self._loop is not None

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    # -- what the test drives ------------------------------------------------------------------

    def jobs(self, namespace: str = "default") -> dict[str, dict[str, Any]]:
        return self.call(lambda: {n: json.loads(json.dumps(o)) for (ns, n), o in self.objects[JOBS].items() if ns == namespace})

    def pods(self, namespace: str = "default") -> dict[str, dict[str, Any]]:
        return self.call(lambda: {n: json.loads(json.dumps(o)) for (ns, n), o in self.objects[PODS].items() if ns == namespace})

    def finish(self, job: str, exit_code: int = 0, namespace: str = "default") -> None:
        """The harness in `job`'s pod exits with `exit_code`."""
        self.call(self._finish, namespace, job, exit_code, "Completed" if exit_code == 0 else "Error")

    def exceed_deadline(self, job: str, namespace: str = "default") -> None:
        """activeDeadlineSeconds passed: the Job fails with DeadlineExceeded and its pod is deleted."""
        self.call(self._deadline, namespace, job)

    @contextlib.contextmanager
    def silently(self) -> Iterator[None]:
        """Changes made inside reach no watch (a missed event); lists still show them."""
        self.call(setattr, self, "_silent", True)
        try:
            yield
        finally:
            self.call(setattr, self, "_silent", False)

    def compact(self) -> None:
        """Forget history: a watch resuming from an older resourceVersion gets 410 Gone."""
        self.call(lambda: setattr(self, "compacted", self._last_rv))

    def drop_watches(self) -> None:
        """Cut every open watch stream (a load balancer's idle timeout, an API server restart)."""
        self.call(lambda: [w.queue.put_nowait(None) for w in self._watchers])

    def fail(
        self, count: int, status: int = 503, *, retry_after: str | None = None, method: str | None = None,
        path: str | None = None,
    ) -> None:
        """The next `count` requests (of `method`, to a path containing `path`) fail with `status`."""
        self.call(self.faults.append, Fault(count, status, retry_after, method, path))

    def live_jobs(self, namespace: str = "default") -> int:
        return sum(1 for job in self.jobs(namespace).values() if not _finished(job))

    # -- state changes (on the server's loop) ---------------------------------------------------

    def _emit(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self._last_rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(self._last_rv)
        if self._silent:
            return
        snapshot = json.loads(json.dumps(obj))
        self.history.append((self._last_rv, resource, kind, snapshot))
        ns = obj["metadata"]["namespace"]
        for watcher in self._watchers:
            if watcher.resource == resource and watcher.namespace == ns and watcher.selector(obj["metadata"].get("labels") or {}):
                watcher.queue.put_nowait({"type": kind, "object": snapshot})

    def _put(self, resource: str, obj: dict[str, Any], kind: str = "MODIFIED") -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objects[resource][key] = obj
        self._emit(resource, kind, obj)

    def _remove(self, resource: str, namespace: str, name: str) -> None:
        obj = self.objects[resource].pop((namespace, name), None)
        if obj is not None:
            self._emit(resource, "DELETED", obj)

    def _pod_of(self, namespace: str, job: str) -> dict[str, Any] | None:
        for (ns, _), pod in self.objects[PODS].items():
            if ns == namespace and pod["metadata"]["labels"].get("job-name") == job:
                return pod
        return None

    def _set_pod(self, namespace: str, job: str, **status: Any) -> None:
        pod = self._pod_of(namespace, job)
        if pod is not None:
            pod["status"].update(status)
            self._put(PODS, pod)

    def _set_job(self, namespace: str, job: str, **status: Any) -> None:
        obj = self.objects[JOBS].get((namespace, job))
        if obj is not None:
            obj["status"].update(status)
            self._put(JOBS, obj)

    def _new_pod(self, job: dict[str, Any]) -> None:
        meta, template = job["metadata"], job["spec"]["template"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        labels = {**((template.get("metadata") or {}).get("labels") or {}), "job-name": meta["name"],
                  "batch.kubernetes.io/job-name": meta["name"], "controller-uid": meta["uid"]}  # fmt: skip
        pod = {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": f"{meta['name']}-{suffix}", "namespace": meta["namespace"], "labels": labels,
                         "uid": _uid(), "creationTimestamp": _now(),
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                              "uid": meta["uid"], "controller": True}]},
            "spec": json.loads(json.dumps(template["spec"])),
            "status": {"phase": "Pending"},
        }  # fmt: skip
        self._put(PODS, pod, "ADDED")
        self._set_job(meta["namespace"], meta["name"], active=1, startTime=_now(), ready=0)

    def _container(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": "harness", "image": "img", "imageID": "", "ready": False, "restartCount": 0, "state": state}]

    def _scheduled(self, ok: bool = True, reason: str = "", message: str = "") -> list[dict[str, Any]]:
        condition: dict[str, Any] = {"type": "PodScheduled", "status": "True" if ok else "False",
                                     "lastTransitionTime": _now()}  # fmt: skip
        if not ok:
            condition.update(reason=reason, message=message)
        return [condition]

    def _finish(self, ns: str, job: str, code: int, reason: str) -> None:
        terminated = {"exitCode": code, "reason": reason, "startedAt": _now(), "finishedAt": _now()}
        self._set_pod(ns, job, phase="Succeeded" if code == 0 else "Failed", containerStatuses=self._container({"terminated": terminated}))
        if code == 0:
            conditions = [_condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
                          _condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods")]  # fmt: skip
            self._set_job(ns, job, active=0, ready=0, succeeded=1, completionTime=_now(), conditions=conditions)
        else:
            conditions = [_condition("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
                          _condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")]  # fmt: skip
            self._set_job(ns, job, active=0, ready=0, failed=1, conditions=conditions)

    def _deadline(self, ns: str, job: str) -> None:
        pod = self._pod_of(ns, job)
        if pod is not None:
            self._remove(PODS, ns, pod["metadata"]["name"])
        conditions = [_condition("FailureTarget", "DeadlineExceeded", "Job was active longer than specified deadline"),
                      _condition("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")]  # fmt: skip
        self._set_job(ns, job, active=0, ready=0, failed=1, conditions=conditions)

    async def _play(self, job: dict[str, Any], scenario: str) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        step = lambda: asyncio.sleep(self.step_s)  # noqa: E731
        await step()
        if scenario == "no_pod":
            self.events_log.append({
                "metadata": {"name": f"{name}.{_uid()[:8]}", "namespace": ns},
                "involvedObject": {"kind": "Job", "name": name, "namespace": ns, "apiVersion": "batch/v1"},
                "reason": "FailedCreate", "type": "Warning", "count": 1,
                "message": f'Error creating: pods "{name}-x" is forbidden: exceeded quota: compute, '
                           "requested: limits.cpu=2, used: limits.cpu=8, limited: limits.cpu=8",
            })  # fmt: skip
            return
        self._new_pod(job)
        await step()
        if scenario == "unschedulable":
            message = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
            self._set_pod(ns, name, conditions=self._scheduled(False, "Unschedulable", message))
            return
        waiting = {"waiting": {"reason": "ContainerCreating"}}
        self._set_pod(ns, name, conditions=self._scheduled(), containerStatuses=self._container(waiting))
        await step()
        image = job["spec"]["template"]["spec"]["containers"][0]["image"]
        if scenario in ("image_pull", "invalid_image"):
            if scenario == "invalid_image":
                waiting = {"waiting": {"reason": "InvalidImageName", "message": f'Failed to apply default image tag "{image}"'}}
                self._set_pod(ns, name, containerStatuses=self._container(waiting))
                return
            pull = f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to resolve reference'
            self._set_pod(ns, name, containerStatuses=self._container({"waiting": {"reason": "ErrImagePull", "message": pull}}))
            await step()
            backoff = {"waiting": {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}}
            self._set_pod(ns, name, containerStatuses=self._container(backoff))
            return
        if scenario == "evict":
            self._set_pod(ns, name, phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
            conditions = [_condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")]
            self._set_job(ns, name, active=0, failed=1, conditions=conditions)
            return
        env = self._container_env(job)
        if isinstance(env, str):  # a secret or key the pod names is missing: the kubelet cannot start it
            self._set_pod(ns, name, containerStatuses=self._container({"waiting": {"reason": "CreateContainerConfigError", "message": env}}))
            return
        self._set_pod(ns, name, phase="Running", containerStatuses=self._container({"running": {"startedAt": _now()}}))
        self._set_job(ns, name, ready=1)
        if scenario == "hold":
            return
        if scenario == "exec":
            await self._exec(job, env)
            return
        await step()
        if scenario == "oom":
            self._finish(ns, name, 137, "OOMKilled")
        elif scenario.startswith("fail:"):
            pod = self._pod_of(ns, name)
            if pod is not None:  # what the harness printed before it failed
                self.logs[pod["metadata"]["name"]] = '{"step": 1}\nTraceback (most recent call last):\nValueError: bad task\n'
            self._finish(ns, name, int(scenario.split(":", 1)[1]), "Error")
        else:
            self._finish(ns, name, 0, "Completed")

    def _container_env(self, job: dict[str, Any]) -> dict[str, str] | str:
        """The container's environment as the kubelet builds it, or why it cannot."""
        container = job["spec"]["template"]["spec"]["containers"][0]
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            name = source["secretRef"]["name"]
            if name not in self.secrets:
                return f'secret "{name}" not found'
            env.update(self.secrets[name])
        for item in container.get("env") or []:
            ref = (item.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                env[item["name"]] = item.get("value", "")
                continue
            data = self.secrets.get(ref["name"])
            if data is None:
                return f'secret "{ref["name"]}" not found'
            if ref["key"] not in data:
                return f"couldn't find key {ref['key']} in Secret {job['metadata']['namespace']}/{ref['name']}"
            env[item["name"]] = data[ref["key"]]
        return env

    async def _exec(self, job: dict[str, Any], env: dict[str, str]) -> None:
        """Run the container's command as a local process (the image is this machine): a kubelet."""
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        container = job["spec"]["template"]["spec"]["containers"][0]
        pod = self._pod_of(ns, name)
        process = await asyncio.create_subprocess_exec(
            *container["command"], env={**self.exec_env, **env}, cwd=container.get("workingDir"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        self._procs[name] = process
        output, _ = await process.communicate()
        self._procs.pop(name, None)
        if pod is not None:
            self.logs[pod["metadata"]["name"]] = output.decode(errors="replace")
        if (ns, name) in self.objects[JOBS]:
            code = process.returncode or 0
            self._finish(ns, name, code if code >= 0 else 128 - code, "Completed" if code == 0 else "Error")

    # -- the HTTP API ---------------------------------------------------------------------------

    @web.middleware
    async def _faulty(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        self.authorizations.add(request.headers.get("Authorization", ""))
        fault = next((f for f in self.faults if f.count > 0 and f.method in (None, request.method)
                      and (f.path is None or f.path in request.path)), None)  # fmt: skip
        if fault is None:
            return await handler(request)
        fault.count -= 1
        self.failed.append((request.method, request.path, fault.status))
        if fault.status == 0:
            assert request.transport is not None
            request.transport.abort()  # the client sees the connection reset, no status line
            return web.Response(status=500)
        reasons = {429: "TooManyRequests", 500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable",
                   504: "Timeout"}  # fmt: skip
        response = _error(fault.status, reasons.get(fault.status, "InternalError"),
                          f"the server is currently unable to handle the request (fault {fault.status})")  # fmt: skip
        if fault.retry_after is not None:
            response.headers["Retry-After"] = fault.retry_after
        return response

    async def _jobs(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        if request.method == "POST":
            return self._create(ns, await request.json())
        if request.method == "GET":
            return await self._list_or_watch(request, JOBS, "JobList", "batch/v1")
        return _error(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    def _create(self, ns: str, body: dict[str, Any]) -> web.Response:
        self.created.append(json.loads(json.dumps(body)))
        name = (body.get("metadata") or {}).get("name")
        containers = (((body.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers")
        if not name:
            return _error(422, "Invalid", "Job.batch \"\" is invalid: metadata.name: Required value: name or generateName is required")
        if not containers:
            return _error(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template.spec.containers: Required value', name=name, group="batch", kind="Job")
        restart = body["spec"]["template"]["spec"].get("restartPolicy")
        if restart not in ("Never", "OnFailure"):
            return _error(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template.spec.restartPolicy: Required value: valid values: "OnFailure", "Never"', name=name, group="batch", kind="Job")
        if (ns, name) in self.objects[JOBS]:
            return _error(409, "AlreadyExists", f'jobs.batch "{name}" already exists', name=name, group="batch", kind="jobs")
        live = sum(1 for (n, _), job in self.objects[JOBS].items() if n == ns)
        if self.job_quota is not None and live >= self.job_quota:
            return _error(403, "Forbidden", f'jobs.batch "{name}" is forbidden: exceeded quota: jobs, requested: count/jobs.batch=1, used: count/jobs.batch={live}, limited: count/jobs.batch={self.job_quota}', name=name, group="batch", kind="jobs")
        job = json.loads(json.dumps(body))
        job["metadata"].update(namespace=ns, uid=_uid(), creationTimestamp=_now(), generation=1)
        job["status"] = {}
        self._put(JOBS, job, "ADDED")
        self.max_live = max(self.max_live, sum(1 for j in self.objects[JOBS].values() if not _finished(j)))
        task = asyncio.get_running_loop().create_task(self._play(job, self.scenario(job)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return web.json_response(job, status=201)

    async def _job(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        job = self.objects[JOBS].get((ns, name))
        if job is None:
            return _error(404, "NotFound", f'jobs.batch "{name}" not found', name=name, group="batch", kind="jobs")
        if request.method == "GET":
            return web.json_response(job)
        if request.method == "DELETE":
            body = await request.json() if request.can_read_body else {}
            policy = request.query.get("propagationPolicy") or (body or {}).get("propagationPolicy") or "Orphan"
            self.deleted.append(name)
            process = self._procs.pop(name, None)
            if process is not None and process.returncode is None:
                process.kill()  # the pod's containers are killed with it
            if policy in ("Background", "Foreground"):
                pod = self._pod_of(ns, name)
                if pod is not None:
                    self._remove(PODS, ns, pod["metadata"]["name"])
            self._remove(JOBS, ns, name)
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "details": {"name": name, "group": "batch", "kind": "jobs", "uid": job["metadata"]["uid"]}})  # fmt: skip
        return _error(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._list_or_watch(request, PODS, "PodList", "v1")

    async def _pod_log(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        if (ns, name) not in self.objects[PODS]:
            return _error(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods")
        lines = self.logs.get(name, "").splitlines(keepends=True)
        tail = int(request.query.get("tailLines", 0) or 0)
        return web.Response(text="".join(lines[-tail:] if tail else lines), content_type="text/plain")

    async def _events(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        field = request.query.get("fieldSelector", "")
        wanted = field.split("=", 1)[1] if field.startswith("involvedObject.name=") else None
        items = [e for e in self.events_log if e["metadata"]["namespace"] == ns and wanted in (None, e["involvedObject"]["name"])]
        return web.json_response({"kind": "EventList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._last_rv)}, "items": items})

    async def _list_or_watch(self, request: web.Request, resource: str, list_kind: str, api: str) -> web.StreamResponse:
        ns = request.match_info["ns"]
        selector = parse_selector(request.query.get("labelSelector"))
        matching = [o for (n, _), o in self.objects[resource].items() if n == ns and selector(o["metadata"].get("labels") or {})]
        if request.query.get("watch") not in GO_TRUE:
            self.list_requests += 1
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in matching]
            return web.json_response({"kind": list_kind, "apiVersion": api, "metadata": {"resourceVersion": str(self._last_rv)}, "items": items})
        self.watch_requests += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        await response.prepare(request)
        since = request.query.get("resourceVersion")
        watcher = _Watcher(resource, ns, selector)
        if since not in (None, "", "0") and int(since) < self.compacted:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.compacted})")
            await response.write((json.dumps({"type": "ERROR", "object": gone}) + "\n").encode())
            return response
        if since in (None, "", "0"):
            backlog = [{"type": "ADDED", "object": json.loads(json.dumps(o))} for o in matching]
        else:
            backlog = [{"type": kind, "object": obj} for rv, res, kind, obj in self.history
                       if rv > int(since) and res == resource and obj["metadata"]["namespace"] == ns
                       and selector(obj["metadata"].get("labels") or {})]  # fmt: skip
        for event in backlog:  # no await between reading the history and subscribing
            watcher.queue.put_nowait(event)
        self._watchers.append(watcher)
        timeout = float(request.query.get("timeoutSeconds", 1800))
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if event is None:
                    break
                await response.write((json.dumps(event) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(watcher)
        return response


def _condition(kind: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message,
            "lastProbeTime": _now(), "lastTransitionTime": _now()}  # fmt: skip


def _finished(job: dict[str, Any]) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or [])  # fmt: skip


def _uid() -> str:
    return "".join(random.choices("0123456789abcdef", k=32))
