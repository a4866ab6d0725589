"""examples/swe/sandbox.py: a bash command of the agent cannot reach the network (not even a server
on this machine's loopback) while the same command in mini-swe-agent's plain local environment can;
files it writes land in the workspace; the time limit still ends a command."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from examples.swe.sandbox import isolated_environment, require_isolation

CONNECT = "python3 -c \"import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2); print('reached')\" {port}"


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def test_a_command_without_network_cannot_reach_a_local_server(tmp_path: Path, listening_port: int) -> None:
    from minisweagent.environments.local import LocalEnvironment

    require_isolation()
    command = {"command": CONNECT.format(port=listening_port)}
    assert "reached" in LocalEnvironment(cwd=str(tmp_path)).execute(command)["output"]  # the server is there
    isolated = isolated_environment(cwd=str(tmp_path)).execute(command)
    assert isolated["returncode"] != 0 and "reached" not in isolated["output"]
    assert "Network is unreachable" in isolated["output"]


def test_the_isolated_command_works_in_the_workspace_within_its_time_limit(tmp_path: Path) -> None:
    environment = isolated_environment(cwd=str(tmp_path), timeout=1)
    assert environment.execute({"command": "echo fixed > out.txt && cat out.txt"})["output"] == "fixed\n"
    assert (tmp_path / "out.txt").read_text() == "fixed\n"
    slow = environment.execute({"command": "sleep 5"})
    assert slow["returncode"] == -1 and "timed out" in slow["exception_info"]


def test_a_machine_without_unshare_gets_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.swe import sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.IsolationError, match=r"needs `unshare`.*--network host"):
        require_isolation()
