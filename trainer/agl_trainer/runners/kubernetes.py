"""Run the harness once per rollout as a Kubernetes Job, for more rollouts than one machine holds.

Each rollout attempt is a Job (kubernetes_manifest: image, command, resources, service account,
node selector, tolerations, secrets, TTL, deadline, backoffLimit 0: retries are the runner's, for
infrastructure failures only) whose container gets the same environment as a local harness process
(runners.base.Endpoint) with the sidecar's address as pods reach it (harness.kubernetes.sidecar_url
or sidecar.advertise_url). Jobs go through the official `kubernetes` client (kubeconfig, or the
pod's service account in a cluster), its synchronous calls on a thread pool of the runner's own.

At most `max_jobs` Jobs exist at once and at most `create_rate` are created a second. The runner
learns how they end from a watch on Jobs and one on Pods plus a periodic list (kubernetes_watch),
so a missed event never strands a rollout. A pod that cannot start (image pull back-off,
unschedulable, no pod at all: a quota) fails the attempt with the reason once it has lasted
`start_timeout_s` (at once for reasons that never clear, like an invalid image name); the Job is
deleted, the outcome is infra_error (retried as the next attempt). Cancelled rollouts delete their
Job; stop() deletes every unfinished Job of this runner. Finished Jobs stay for `ttl_s` (logs:
`kubectl logs -n NAMESPACE job/NAME`). Every API call backs off and tries again while the API server
is away or answers 429/5xx (kubernetes_retry); once the tries are spent the attempt fails with the
server's address and status as its cause (infra_error), and the training loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agl import semconv

from agl_trainer.runners.base import (
    Cause,
    Endpoint,
    ExitHook,
    RolloutOutcome,
    RolloutSpec,
    call_hook,
    run_with_retries,
)
from agl_trainer.runners.kubernetes_config import unreachable_from_pods
from agl_trainer.runners.kubernetes_manifest import (
    CONTAINER,
    LABEL_RUNNER,
    JobTemplate,
    build_job_manifest,
    check_job_manifest,
    job_name,
)
from agl_trainer.runners.kubernetes_retry import ApiUnavailable, Backoff, call_with_backoff, describe
from agl_trainer.runners.kubernetes_status import NotStarted, Verdict, classify_job, job_finished, job_verdict, not_started
from agl_trainer.runners.kubernetes_watch import JobState, JobTracker
from agl_trainer.runners.ratelimit import RateLimiter

__all__ = ["KubernetesRunner", "build_job_manifest", "classify_job", "job_name"]

log = logging.getLogger(__name__)
API_THREADS = 8
LOG_TAIL_LINES = 2000


class KubernetesRunner:
    def __init__(
        self,
        template: JobTemplate,
        endpoint: Endpoint,
        *,
        concurrency: int = 64,
        create_rate: float = 5.0,
        start_timeout_s: float = 300.0,
        reconcile_s: float = 15.0,
        retries: int = 2,
        on_exit: ExitHook | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        api_client: Any = None,
        runner_id: str | None = None,
        log_dir: Path | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.template = template
        self.backoff = backoff or Backoff()  # for every API call (kubernetes_retry)
        self.endpoint = endpoint
        self.retries = retries
        self.on_exit = on_exit
        self.start_timeout_s = start_timeout_s
        self.reconcile_s = reconcile_s
        self.kubeconfig, self.context = kubeconfig, context
        self.log_dir = log_dir  # failed attempts' pod logs are copied here (Jobs go after ttl_s)
        self.runner_id = runner_id or secrets.token_hex(3)
        self.selector = f"{LABEL_RUNNER}={self.runner_id}"
        self._api_client = api_client
        self._slots = asyncio.Semaphore(concurrency)
        self._rate = RateLimiter(create_rate, burst=max(1, int(create_rate)))
        self._executor = ThreadPoolExecutor(API_THREADS, thread_name_prefix="agl-kube")
        self._stopping = False
        self.tracker: JobTracker | None = None
        self.batch: Any = None
        self.core: Any = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        from kubernetes import client

        urls = [self.endpoint.sidecar_url, *(url for url, _ in getattr(self.endpoint, "sidecars", None) or [])]
        for url in urls:
            if not unreachable_from_pods(url):
                continue
            raise RuntimeError(
                f"the kubernetes runner would send pods to {url}, this machine's loopback "
                "(fix: set sidecar.advertise_url or harness.kubernetes.sidecar_url to the address pods reach)"
            )
        plain = plain_secrets(self.endpoint, self.template)
        if plain:
            log.warning(
                "the kubernetes runner puts %s in every Job's spec as plain text (anyone who can read Jobs in "
                "namespace %s reads them); fix: a Secret and harness.kubernetes.secret_env, e.g. {%s: SECRET/KEY}",
                ", ".join(plain), self.template.namespace, plain[0],
            )  # fmt: skip
        if self._api_client is None:
            self._api_client = await asyncio.to_thread(load_api_client, self.kubeconfig, self.context)
        self.batch = client.BatchV1Api(self._api_client)
        self.core = client.CoreV1Api(self._api_client)
        self.tracker = JobTracker(
            self.batch, self.core, self.template.namespace, self.selector, self._executor,
            reconcile_s=self.reconcile_s, backoff=self.backoff,
        )  # fmt: skip
        log.info("kubernetes runner %s: Jobs labelled %s in namespace %s", self.runner_id, self.selector,
                 self.template.namespace)  # fmt: skip
        try:
            await self.tracker.start()
        except Exception as error:
            why = str(error) if isinstance(error, ApiUnavailable) else f"{self.host}: {_api_error(error)}"
            raise RuntimeError(
                f"the kubernetes runner cannot list Jobs in namespace {self.template.namespace}: "
                f"{why} (fix: harness.kubernetes.kubeconfig / context, and RBAC: create, get, list, "
                "watch, delete on jobs; list, watch on pods; list on events)"
            ) from None

    async def stop(self) -> None:
        self._stopping = True
        if self.tracker is not None:
            names = {name for name, state in self.tracker.states.items() if not _finished(state)}
            with contextlib.suppress(Exception):  # Jobs of this runner nobody is waiting on any more
                listing = await self._call(self.batch.list_namespaced_job, self.template.namespace,
                                           label_selector=self.selector)  # fmt: skip
                names |= {job.metadata.name for job in listing.items if not job_finished(_plain(self.batch, job))}
            await asyncio.gather(*(self._delete(name) for name in sorted(names)))
            for state in self.tracker.states.values():  # wake rollouts still waiting: their Jobs are gone
                if not _finished(state):
                    state.gone = True
                    state.changed.set()
            await self.tracker.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- rollouts -----------------------------------------------------------------------------

    async def run(self, spec: RolloutSpec) -> RolloutOutcome:
        async with self._slots:
            return await run_with_retries(self._attempt, spec, self.retries, stopping=lambda: self._stopping)

    async def _attempt(self, spec: RolloutSpec) -> RolloutOutcome:
        assert self.tracker is not None, "start() the runner first"
        started = time.monotonic()
        manifest = build_job_manifest(spec, self.endpoint, self.template, runner_id=self.runner_id)
        check_job_manifest(manifest)
        name = manifest["metadata"]["name"]
        state = self.tracker.track(name)
        try:
            outcome = await self._create_and_wait(spec, manifest, state)
        except asyncio.CancelledError:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._delete(name))
            raise
        finally:
            self.tracker.forget(name)
        outcome.seconds = time.monotonic() - started
        await call_hook(self.on_exit, outcome)
        return outcome

    async def _create_and_wait(self, spec: RolloutSpec, manifest: dict[str, Any], state: JobState) -> RolloutOutcome:
        from kubernetes.client.exceptions import ApiException

        name, namespace = state.name, self.template.namespace
        await self._rate.acquire()
        loop = asyncio.get_running_loop()

        async def create() -> Any:
            creating = loop.run_in_executor(self._executor, lambda: self.batch.create_namespaced_job(namespace, manifest))
            try:
                return await asyncio.shield(creating)
            except asyncio.CancelledError:  # let the create land first, so the caller's delete finds the Job
                await asyncio.wait([creating], timeout=30)
                raise

        try:
            # A retried create whose first try landed after all answers 409: adopted below.
            created = await call_with_backoff(create, self.backoff, self.host, on_retry=self._retrying(f"create job {name}"))
        except ApiUnavailable as error:
            return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"could not create job {name}: {error}")
        except ApiException as error:
            if error.status != 409:
                return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"could not create job {name}: {_api_error(error)}")
            # Already there: our own create whose response was lost (a retried request), or not ours.
            try:
                created = await self._call(self.batch.read_namespaced_job, name, namespace)
            except Exception as again:  # deleted meanwhile, or the server went away
                return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"job {name}: {_api_error(again)}")
            if (created.metadata.labels or {}).get(LABEL_RUNNER) != self.runner_id:
                return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"job {name} exists and is not this runner's")
        except Exception as error:  # not the API's answer, nor an outage (kubernetes_retry): a client error
            return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"could not create job {name}: {error}")
        state.created_rv = created.metadata.resource_version
        state.update_job(_plain(self.batch, created))
        return await self._wait(spec, state)

    async def _wait(self, spec: RolloutSpec, state: JobState) -> RolloutOutcome:
        loop = asyncio.get_running_loop()
        name = state.name
        created_at = loop.time()
        stuck_since: float | None = None
        give_up_after = self.template.timeout_s + self.start_timeout_s + 60  # the deadline itself is the Job's
        poll = min(1.0, self.start_timeout_s / 4)
        while True:
            state.changed.clear()  # before reading: a report arriving from here on wakes the wait below
            if state.job is not None and job_finished(state.job):
                pods = list(state.pods.values())
                if not any((p.get("status") or {}).get("phase") in ("Succeeded", "Failed") for p in pods):
                    with contextlib.suppress(Exception):  # the pod's report may trail the Job's
                        pods = await self.tracker.pods_of(name)  # type: ignore[union-attr]
                verdict = job_verdict(state.job, pods)
                assert verdict is not None
                outcome = self._outcome(spec, verdict)
                if not outcome.ok:
                    outcome.log_path = await self._save_log(spec, pods)
                return outcome
            if state.gone:
                if self._stopping:  # stop() deleted it
                    return RolloutOutcome(spec, Cause.CANCELLED, message=f"job {name} deleted: the runner stopped")
                return RolloutOutcome(spec, Cause.INFRA_ERROR, message=f"job {name} was deleted before it finished")
            now = loop.time()
            why = not_started(list(state.pods.values()))
            if why is None and not state.pods and now - created_at >= self.start_timeout_s:
                why = NotStarted("NoPod", f"no pod was created{await self._job_events(name)}")
                stuck_since = created_at
            if why is None:
                stuck_since = None
            else:
                stuck_since = now if stuck_since is None else stuck_since
                if why.permanent or now - stuck_since >= self.start_timeout_s:
                    await self._delete(name)
                    message = f"job {name} never started: {why.message}"
                    return RolloutOutcome(spec, Cause.INFRA_ERROR, message=message)
            if now - created_at > give_up_after:
                await self._delete(name)
                return RolloutOutcome(spec, Cause.TIMEOUT, message=f"job {name} did not end in {give_up_after:g} s")
            # asyncio.wait, not wait_for: on Python 3.11 wait_for swallows a cancellation that lands
            # as the event fires, and a cancelled rollout would go on waiting for its Job.
            waiter = asyncio.ensure_future(state.changed.wait())
            try:
                await asyncio.wait({waiter}, timeout=poll)
            finally:
                waiter.cancel()

    def _outcome(self, spec: RolloutSpec, verdict: Verdict) -> RolloutOutcome:
        message = verdict.message
        if verdict.cause is not Cause.OK:
            message += f" (logs: kubectl logs -n {self.template.namespace} job/{job_name(spec, self.runner_id)})"
        return RolloutOutcome(spec, verdict.cause, verdict.exit_code, message=message)

    async def _save_log(self, spec: RolloutSpec, pods: list[dict[str, Any]]) -> str | None:
        """The end of a failed attempt's pod log, copied to log_dir (named as the local runner names it)."""
        if self.log_dir is None or not pods:
            return None
        pod = (pods[-1].get("metadata") or {}).get("name", "")
        try:  # raw bytes: the client would parse a log that happens to be JSON
            response = await self._call(
                self.core.read_namespaced_pod_log, pod, self.template.namespace,
                container=CONTAINER, tail_lines=LOG_TAIL_LINES, _preload_content=False,
            )  # fmt: skip
            text = response.data.decode("utf-8", errors="replace")
        except Exception as error:
            log.info("no log for pod %s: %s", pod, _api_error(error))
            return None
        suffix = f".attempt{spec.attempt}" if spec.attempt else ""
        path = self.log_dir / f"{spec.rollout_id}{suffix}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# kubectl logs -n {self.template.namespace} {pod} -c {CONTAINER} --tail {LOG_TAIL_LINES}\n{text}")
        return str(path)

    async def _job_events(self, name: str) -> str:
        """The Job's latest warning (FailedCreate: exceeded quota ...), as ': reason: message'."""
        try:
            events = await self._call(
                self.core.list_namespaced_event, self.template.namespace, field_selector=f"involvedObject.name={name}"
            )
        except Exception:
            return ""
        warnings = [e for e in events.items if e.type == "Warning"] or list(events.items)
        if not warnings:
            return ""
        latest = warnings[-1]
        return f": {latest.reason}: {latest.message}"

    async def _delete(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            await self._call(
                self.batch.delete_namespaced_job, name, self.template.namespace, propagation_policy="Background"
            )
        except ApiException as error:
            if error.status != 404:
                log.warning("could not delete job %s: %s", name, _api_error(error))
        except Exception as error:
            log.warning("could not delete job %s: %s", name, error)

    @property
    def host(self) -> str:
        """The API server's address, as errors name it."""
        return str(getattr(getattr(self._api_client, "configuration", None), "host", None) or "(not connected)")

    def _retrying(self, what: str) -> Any:
        def report(error: BaseException, wait: float) -> None:
            log.warning("kubernetes: %s at %s: %s; trying again in %.1f s", what, self.host, describe(error), wait)

        return report

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the API thread pool, tried again on transient failures (kubernetes_retry)."""
        loop = asyncio.get_running_loop()
        name = getattr(fn, "__name__", "call")
        return await call_with_backoff(
            lambda: loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs)),
            self.backoff, self.host, on_retry=self._retrying(name),
        )  # fmt: skip


SECRET_BEARING = (semconv.ENV_OPENAI_API_KEY, semconv.ENV_ANTHROPIC_API_KEY, semconv.ENV_OTLP_HEADERS, semconv.ENV_SIDECAR_ADMIN_TOKEN)


def plain_secrets(endpoint: Endpoint, template: JobTemplate) -> list[str]:
    """Variables that would carry a key or token as a plain value in the Job spec."""
    env = endpoint.environment(RolloutSpec("check", "task", {}))
    return [
        name for name in SECRET_BEARING
        if env.get(name) not in (None, "", semconv.PLACEHOLDER_API_KEY) and name not in template.secret_env
    ]  # fmt: skip


def _finished(state: JobState) -> bool:
    return state.job is not None and job_finished(state.job)


def _plain(api: Any, model: Any) -> dict[str, Any]:
    return api.api_client.sanitize_for_serialization(model)  # type: ignore[no-any-return]


_api_error = describe  # an ApiException as 'status reason: the API server's message'


def load_api_client(kubeconfig: str | None, context: str | None) -> Any:
    """The cluster's client: the kubeconfig given, else the pod's service account, else ~/.kube/config."""
    from kubernetes import client
    from kubernetes import config as kube_config

    configuration = client.Configuration()
    try:
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            kube_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    except (kube_config.ConfigException, OSError, TypeError) as error:
        raise RuntimeError(
            f"config key harness.kubernetes.kubeconfig: cannot load the cluster's config: {error} "
            "(fix: point it at a kubeconfig file, or run `agl train` in a pod with a service account)"
        ) from None
    configuration.connection_pool_maxsize = API_THREADS + 4  # the pool's threads plus the two watches
    return client.ApiClient(configuration)
