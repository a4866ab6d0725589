"""Start the receiver and the sidecar where the topology says, or attach to the sidecars you run.

    receiver, receiver_url = start_receiver(topology, store_path)
    sidecars = await start_sidecars(topology, config, engine_urls, receiver_url, out, stack)
    sidecars.admin      # SidecarAdmin, or SidecarFleet over several
    sidecars.endpoint(receiver_url, extra_env)   # what runners hand harnesses
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from agl import semconv

from agl_trainer.config import Config
from agl_trainer.run.fleet import SidecarFleet
from agl_trainer.loop.ports import Resume, SidecarError
from agl_trainer.run.sidecar_client import SidecarAdmin, SidecarProcess
from agl_trainer.run.topology import Topology, format_headers
from agl_trainer.runners.base import Endpoint


def start_receiver(topology: Topology, store_path: Path) -> tuple[Any, str, str]:
    """The receiver, started; (receiver, its advertised URL, a URL this machine dials)."""
    from agl_trainer.receiver import Receiver, ReceiverConfig

    listen = topology.receiver_listen
    config = ReceiverConfig(host=listen.host, port=listen.port, token=topology.receiver_token)
    try:
        receiver = Receiver(store_path, config).start()
    except OSError as error:
        from agl_trainer.config import ConfigError

        raise ConfigError(f"config key receiver.listen: cannot listen on {listen.flag}: {error}") from None
    port = urlsplit(receiver.url).port or listen.port
    return receiver, topology.receiver_url(port), listen.local_url(port)


@dataclass
class Sidecars:
    admin: Any  # SidecarAdmin | SidecarFleet
    targets: list[tuple[str, str | None]]  # (harness URL, harness key) of each sidecar
    topology: Topology

    def endpoint(self, receiver_url: str, harness_env: dict[str, str]) -> Endpoint:
        extra: dict[str, str] = {}
        keys = {key for _, key in self.targets}
        if len(keys) == 1 and None not in keys:  # one key for all: runner workers get it too
            extra["OPENAI_API_KEY"] = extra["ANTHROPIC_API_KEY"] = str(next(iter(keys)))
        headers = self.topology.otlp_headers()
        if headers:
            extra[semconv.ENV_OTLP_HEADERS] = format_headers(headers)
        extra.update(harness_env)  # the config's harness.env wins
        return Endpoint(
            sidecar_url=self.targets[0][0], otlp_endpoint=receiver_url, extra_env=extra, sidecars=list(self.targets)
        )


async def start_sidecars(
    topology: Topology,
    config: Config,
    engine_urls: list[str],
    receiver_url: str,
    out: Path,
    stack: contextlib.AsyncExitStack,
    *,
    seed: int | None = None,
) -> Sidecars:
    """Attach to the configured sidecars (pointing them at the engine), or start one that exports to
    sidecar.otlp_endpoint (a collector), else to the receiver's URL (advertised: it may be a collector too)."""
    if topology.attached:
        admins = []
        for index, target in enumerate(topology.attached):
            admin = SidecarAdmin(target.admin_url, target.admin_token, harness_key=target.harness_key)
            stack.push_async_callback(admin.aclose)
            await _check_reachable(admin, index if config.sidecar.url is None else None)
            # Its node's engine servers (attach[].upstreams), else every server of the engine.
            await admin.resume(Resume(upstreams=target.upstreams or engine_urls))
            admins.append(admin)
        control: Any = admins[0] if len(admins) == 1 else SidecarFleet(admins)
        targets = [(t.harness_url, t.harness_key) for t in topology.attached]
        return Sidecars(control, targets, topology)

    from agl_trainer.run.build import sidecar_config_file

    listen = topology.sidecar_listen
    collector = topology.sidecar_otlp_endpoint
    process = SidecarProcess(
        engine_urls,
        collector or receiver_url,
        executable=config.sidecar.executable,
        admin_token=topology.admin_token,
        log_path=out / "sidecar.log",
        config_path=sidecar_config_file(config, out / "sidecar.yaml", seed=seed),
        extra_args=["--max-hold-s", str(config.sidecar.max_hold_s)],
        startup_timeout_s=config.sidecar.startup_timeout_s,
        pid_file=out / "sidecar.pid",
        listen_host=listen.host,
        listen_port=listen.port,
        api_key=topology.harness_key,
        # A collector forwards with its own credentials; the receiver's token is for the receiver.
        otlp_headers=None if collector else topology.otlp_headers(),
    )
    await asyncio.to_thread(process.start)
    stack.callback(process.stop)
    admin = SidecarAdmin(process.url, process.admin_token, harness_key=topology.harness_key)
    stack.push_async_callback(admin.aclose)
    harness_url = topology.sidecar_url(process.port)
    return Sidecars(admin, [(harness_url, topology.harness_key)], topology)


async def _check_reachable(admin: SidecarAdmin, index: int | None) -> None:
    key = "sidecar.url" if index is None else f"sidecar.attach.{index}"
    try:
        await admin.state()
    except httpx.HTTPError as error:
        raise SidecarError(
            f"config key {key}: cannot reach the sidecar at {admin.url} ({type(error).__name__}: {error}) "
            "(fix: start it, or correct the URL)"
        ) from None
    except SidecarError as error:
        raise SidecarError(
            f"config key {key}: the sidecar at {admin.url} refused the admin request ({error}) "
            "(fix: its admin token, in the variable admin_token_env names)"
        ) from None
