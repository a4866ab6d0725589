"""The vLLM engine's server processes: launched in their own process groups, waited on until they
answer /health, relaunched on their port when they die (within `max_restarts`), watched by a thread,
and stopped. What a relaunched server must be given again (step delay, adapter id, latest weights)
is the engine's: `on_restart` runs after each relaunch."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agl_trainer.engines.vllm.admin import AdminClient
from agl_trainer.engines.vllm.config import VLLMConfig, VLLMError
from agl_trainer.engines.vllm.process import Server, log_tail, terminate

log = logging.getLogger("agl.engine.vllm")


class Supervisor:
    def __init__(
        self,
        config: VLLMConfig,
        admin: AdminClient,
        command: Callable[[int], list[str]],
        environment: Callable[[], dict[str, str]],
    ) -> None:
        self.config = config
        self._admin = admin
        self._command = command
        self._environment = environment
        self.servers: list[Server] = []
        self.stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def managed(self) -> bool:
        return not self.config.options.urls

    def launch(self, server: Server) -> None:
        assert server.log_path is not None
        cmd = self._command(server.port)
        log.info("vllm: starting replica %d on port %d: %s", server.index, server.port, " ".join(cmd))
        with open(server.log_path, "ab") as log_file:
            log_file.write(f"\n=== agl: {' '.join(cmd)}\n".encode())
            log_file.flush()
            server.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,  # its own process group: stop() reaches the engine core too
            )

    def wait_healthy(self, servers: list[Server]) -> None:
        deadline = time.monotonic() + self.config.options.startup_timeout_s
        pending = list(servers)
        while pending:
            for server in list(pending):
                if server.process is not None and server.process.poll() is not None:
                    raise VLLMError(
                        f"vLLM replica {server.index} exited with code {server.process.returncode} "
                        f"before answering /health ({server.log_path}):\n{log_tail(server.log_path)}"
                    )
                if self._admin.healthy(server.url):
                    log.info("vllm: replica %d healthy at %s", server.index, server.url)
                    pending.remove(server)
            if not pending:
                return
            if self.stopped.is_set():
                raise VLLMError("vllm engine stopped while waiting for servers")
            if time.monotonic() > deadline:
                names = ", ".join(s.url for s in pending)
                tails = "\n".join(f"--- {s.url} ({s.log_path}):\n{log_tail(s.log_path)}" for s in pending)
                raise VLLMError(
                    f"vLLM at {names} not healthy after {self.config.options.startup_timeout_s:.0f} s "
                    f"(raise engine.options.startup_timeout_s if the machine is slow):\n{tails}"
                )
            time.sleep(0.5)

    def dead(self) -> list[Server]:
        """Managed servers whose process exited. Attached servers are only checked: one that does
        not answer /health is an error."""
        out = []
        for server in self.servers:
            if not self.managed:
                if not self._admin.healthy(server.url):
                    raise VLLMError(f"attached vLLM server {server.url} does not answer /health")
            elif server.process is None or server.process.poll() is not None:
                out.append(server)
        return out

    def relaunch(self, server: Server) -> None:
        """Start a dead server again on its port and wait for it (VLLMError past max_restarts)."""
        code = server.process.returncode if server.process is not None else None
        if server.restarts >= self.config.options.max_restarts:
            raise VLLMError(
                f"vLLM replica {server.index} died again (exit {code}) after {server.restarts} restarts "
                f"({server.log_path}):\n{log_tail(server.log_path)}"
            )
        server.restarts += 1
        log.warning(
            "vllm: replica %d (%s) exited with code %s; restarting (%d/%d). Log tail:\n%s",
            server.index, server.url, code, server.restarts, self.config.options.max_restarts, log_tail(server.log_path, 10),
        )  # fmt: skip
        terminate(server.process)  # its engine core may outlive the API server
        self.launch(server)
        self.wait_healthy([server])

    def watch(self, ensure_alive: Callable[[], object]) -> None:
        """Call `ensure_alive` every watchdog_interval_s on a thread until stop()."""
        if self.config.options.watchdog_interval_s <= 0:
            return
        self._watchdog = threading.Thread(target=self._watch, args=(ensure_alive,), name="agl-vllm-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self, ensure_alive: Callable[[], object]) -> None:
        reported: set[str] = set()
        while not self.stopped.wait(self.config.options.watchdog_interval_s):
            try:
                ensure_alive()
            except (VLLMError, OSError) as error:  # keep watching; the next sync raises it
                if str(error) not in reported:  # once, not every interval
                    reported.add(str(error))
                    log.error("vllm: watchdog could not restart a replica: %s", error)

    def terminate_all(self) -> None:
        """SIGTERM each server's process group (API server, engine core, workers), then SIGKILL."""
        running = [server.process for server in self.servers if server.process is not None]
        if running:
            with ThreadPoolExecutor(max_workers=len(running)) as pool:
                list(pool.map(terminate, running))
        for server in self.servers:
            server.process = None

    def join_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=10)
            self._watchdog = None
