"""Peer proxies for the sidecar benchmarks, run side by side with agl-sidecar in the same run.

The litellm proxy and Agent Lightning's gateway (`agl-server`) live in throwaway venvs under /tmp,
made by scripts/setup_bench_peers.sh; each is started here on loopback in front of the bench's fake
vLLM and stopped with its whole process group. Anything that fails raises PeerUnavailable with the
reason, so a bench can print it and carry on with the other targets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from _load import free_port

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup_bench_peers.sh"
LITELLM_VENV = Path(os.environ.get("PEER_LITELLM_VENV", "/tmp/agl-peer-litellm"))
AGL_VENV = Path(os.environ.get("PEER_AGL_VENV", "/tmp/agl-peer-agentlightning"))
MASTER_KEY = "sk-agl-bench-peer"  # the litellm proxy refuses to start without one


class PeerUnavailable(RuntimeError):
    """A peer could not be installed or started; the message says why."""


@dataclass
class Peer:
    name: str
    version: str
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    chat_path: str  # where OpenAI chat completions go
    headers: dict[str, str] = field(default_factory=dict)
    log: Path | None = None

    @property
    def chat_url(self) -> str:
        return self.base + self.chat_path

    def stop(self) -> None:
        """SIGTERM the peer's process group (it may fork workers), then SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        except ProcessLookupError:
            pass
        self.proc.wait()


def _tree(pid: int) -> list[int]:
    """pid and its descendants (a proxy may serve from worker processes)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_rss_mb(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def setup(skip_agentlightning: bool = False) -> None:
    """Run the install script (a no-op once done), echoing its progress lines."""
    env = {**os.environ, **({"PEER_SKIP_AGL": "1"} if skip_agentlightning else {})}
    started = time.perf_counter()
    done = subprocess.run(["bash", str(SETUP)], check=False, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        print(f"  {line}")
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        print(
            f"  setup_bench_peers.sh exited {done.returncode} after {time.perf_counter() - started:.0f}s: {tail}"
        )


def _installed(venv: Path, what: str) -> str:
    stamp = venv / ".installed-stamp"
    if stamp.is_file():
        return stamp.read_text().splitlines()[-1]
    failed = Path(f"{venv}.failed")
    why = (
        failed.read_text().strip()
        if failed.is_file()
        else "no install stamp (setup_bench_peers.sh did not finish it)"
    )
    raise PeerUnavailable(f"{what} not installed in {venv}: {why}")


def _log_tail(log: Path, lines: int = 6) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


def _wait_ready(peer: Peer, path: str, timeout: float) -> float:
    """Poll GET path until it answers 2xx; the process dying or the deadline fail with its log."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if peer.proc.poll() is not None:
            raise PeerUnavailable(
                f"{peer.name} exited with {peer.proc.returncode} while starting: {_log_tail(peer.log)}"
            )
        try:
            with urllib.request.urlopen(
                urllib.request.Request(peer.base + path, headers=peer.headers), timeout=2
            ) as r:
                if 200 <= r.status < 300:
                    return time.monotonic() - started
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    raise PeerUnavailable(f"{peer.name} did not answer {path} within {timeout:.0f}s: {_log_tail(peer.log)}")


def _spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _peer_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["PATH"] = f"{venv}/bin:{env.get('PATH', '')}"
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # else importing litellm reaches for the network
    env["LITELLM_LOG"] = "ERROR"
    return env


def start_litellm(upstream: str, model: str, workdir: Path, timeout: float = 120) -> Peer:
    """The litellm proxy, one worker, `model` routed to the upstream as an OpenAI-compatible vLLM."""
    version = _installed(LITELLM_VENV, "litellm proxy")
    config = workdir / "litellm-config.yaml"
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "model_list": [
                    {
                        "model_name": model,
                        "litellm_params": {
                            "model": f"hosted_vllm/{model}",
                            "api_base": upstream + "/v1",
                            "api_key": "none",
                        },
                    }
                ],
                "general_settings": {"master_key": MASTER_KEY},
                "litellm_settings": {"telemetry": False},
            }
        )
    )
    port = free_port()
    log = workdir / "litellm.log"
    env = _peer_env(LITELLM_VENV)
    # uvicorn's default 5 s keep-alive drops pooled connections between a bench's blocks; 120 s is what
    # Agent Lightning's gateway sets.
    proc = _spawn(
        [
            str(LITELLM_VENV / "bin" / "litellm"),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
            "--keepalive_timeout",
            "120",
        ],
        env,
        log,
        workdir,
    )
    peer = Peer(
        "litellm",
        version,
        proc,
        f"http://127.0.0.1:{port}",
        "/v1/chat/completions",
        {"Authorization": f"Bearer {MASTER_KEY}"},
        log,
    )
    try:
        ready = _wait_ready(peer, "/health/liveliness", timeout)
    except BaseException:
        peer.stop()
        raise
    print(f"  litellm proxy ({version}) ready in {ready:.1f} s on {peer.base}")
    return peer


def start_agentlightning(upstream: str, model: str, workdir: Path, timeout: float = 120) -> Peer:
    """Agent Lightning's gateway with the upstream registered, and one rollout/attempt to proxy for."""
    version = _installed(AGL_VENV, "Agent Lightning")
    port = free_port()
    log = workdir / "agentlightning.log"
    # Hydra overrides; no key = no auth (loopback only). Hydra writes its outputs/ under cwd=workdir.
    proc = _spawn(
        [
            str(AGL_VENV / "bin" / "agl-server"),
            "host=127.0.0.1",
            f"port={port}",
            f"default_proxy.model_name={model}",
            f"hydra.run.dir={workdir}/hydra",
        ],
        _peer_env(AGL_VENV),
        log,
        workdir,
    )
    rollout, attempt = "bench-rollout", "bench-attempt"
    peer = Peer(
        "agentlightning",
        version,
        proc,
        f"http://127.0.0.1:{port}",
        f"/proxy/rollout/{rollout}/attempt/{attempt}/mode/train/openai/v1/chat/completions",
        {},
        log,
    )
    try:
        ready = _wait_ready(peer, "/healthz", timeout)
        # The gateway forwards only for a known rollout, to a registered model server.
        _post_json(peer.base + "/api/models", [{"model": model, "endpoint": upstream + "/v1"}])
        _post_json(peer.base + "/api/rollouts", [{"input": {"task": "bench"}, "rollout_id": rollout}])
    except BaseException:
        peer.stop()
        raise
    print(f"  Agent Lightning gateway ({version}) ready in {ready:.1f} s on {peer.base}")
    return peer


def _post_json(url: str, body: object) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
    except urllib.error.HTTPError as e:
        raise PeerUnavailable(f"POST {url}: HTTP {e.code}: {e.read()[:300]!r}") from None
    except OSError as e:
        raise PeerUnavailable(f"POST {url}: {e}") from None


def start_all(upstream: str, model: str, workdir: Path) -> tuple[list[Peer], dict[str, str]]:
    """Start every peer that can start; returns the peers and, per failed one, why."""
    peers: list[Peer] = []
    failed: dict[str, str] = {}
    try:
        for name, start in (("litellm", start_litellm), ("agentlightning", start_agentlightning)):
            try:
                peers.append(start(upstream, model, workdir))
            except (PeerUnavailable, OSError) as e:
                failed[name] = str(e)
    except BaseException:  # interrupted: leave no peer running
        for peer in peers:
            peer.stop()
        raise
    return peers, failed


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="agl-bench-peers-"))
