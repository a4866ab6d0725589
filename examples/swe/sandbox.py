"""mini-swe-agent's local environment without network: each bash command runs in a new network
namespace (`unshare --net --map-root-user`), where no interface but a down loopback exists, so a
command cannot reach the sidecar, the engine or the internet; the time limit stays mini-swe-agent's
own (`environment.timeout`, the process group killed when it runs out).

    environment = isolated_environment(cwd="/tmp/ws", timeout=20)     # a LocalEnvironment

Needs unprivileged user namespaces (Linux; most distributions allow them). `require_isolation()`
says clearly when this machine does not.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from typing import Any

UNSHARE = ("unshare", "--net", "--map-root-user", "--")


class IsolationError(RuntimeError):
    pass


def require_isolation() -> None:
    """Raise IsolationError (with the fix) unless a command can run in a network namespace here."""
    if shutil.which("unshare") is None:
        raise IsolationError("--network none needs `unshare` (util-linux); install it or pass --network host")
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise IsolationError(
            f"--network none: this machine refuses a network namespace ({probe.stderr.strip()}); allow "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) or pass --network host"
        )


def isolated_environment(**config: Any) -> Any:
    from minisweagent.environments.local import LocalEnvironment

    class NoNetworkEnvironment(LocalEnvironment):
        def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
            wrapped = {**action, "command": shlex.join([*UNSHARE, "bash", "-c", action.get("command", "")])}
            return super().execute(wrapped, cwd, timeout=timeout)

    return NoNetworkEnvironment(**config)
