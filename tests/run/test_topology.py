"""Addresses and auth of `agl train`: listen vs advertised URLs, checked at start; auth on off
loopback, the secrets reaching harnesses and sidecars by environment; sidecars you run, attached."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl_trainer.config import ConfigError, load_config
from agl_trainer.run.sidecar_client import SidecarProcess
from agl_trainer.run.topology import parse_listen, resolve
from agl_trainer.store import RolloutStore
from tests.loop.test_loop import make_config, run_session
from tests.support.pipeline import run_config
from tests.support.ports import free_port


def config_with(**keys: Any):
    return load_config(None, [f"--{k}={v}" for k, v in keys.items()], check_paths=False)


# --- checks at start ------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["sidecar", "receiver"])
@pytest.mark.parametrize("listen", ["0.0.0.0:8400", "[::]:8400"])
def test_a_wildcard_listen_without_an_advertised_url_names_the_key(key: str, listen: str) -> None:
    with pytest.raises(ConfigError, match=rf"config key {key}\.advertise_url: {key}\.listen .* wildcard.*fix"):
        resolve(config_with(**{f"{key}.listen": listen}), environ={})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("sidecar.listen", "localhost"),
        ("sidecar.listen", "host:port"),
        ("receiver.listen", ":4318"),
        ("receiver.listen", "127.0.0.1:70000"),
        ("sidecar.advertise_url", "trainer:8400"),
        ("sidecar.advertise_url", "http://0.0.0.0:8400"),
        ("receiver.advertise_url", "ftp://trainer:4318"),
        ("sidecar.otlp_endpoint", "collector:4318"),
    ],
)
def test_a_malformed_address_names_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"config key {key}: .*{value}"):
        resolve(config_with(**{key: value}), environ={})


def test_ipv6_listen_addresses_parse() -> None:
    assert parse_listen("k", "[::1]:8400").host == "::1" and parse_listen("k", "[::1]:8400").loopback
    assert parse_listen("k", "[::]:0").wildcard


def test_on_loopback_no_auth_by_default() -> None:
    topology = resolve(config_with(), environ={})
    assert topology.harness_key is None and topology.receiver_token is None
    assert topology.admin_token  # the trainer always holds its own sidecar's admin token


def test_off_loopback_auth_is_generated_and_reused_by_resume() -> None:
    config = config_with(
        **{
            "sidecar.listen": "0.0.0.0:8400",
            "sidecar.advertise_url": "http://trainer.internal:8400",
            "receiver.listen": "0.0.0.0:4318",
            "receiver.advertise_url": "http://trainer.internal:4318/",
        }
    )
    first = resolve(config, environ={})
    assert first.harness_key and first.receiver_token and first.admin_token
    assert len({first.harness_key, first.receiver_token, first.admin_token}) == 3
    assert first.sidecar_url(8400) == "http://trainer.internal:8400"
    assert first.receiver_url(4318) == "http://trainer.internal:4318"
    saved = {"harness_key": first.harness_key, "admin_token": first.admin_token, "receiver_token": first.receiver_token}
    again = resolve(config, environ={}, saved=saved)
    assert (again.harness_key, again.admin_token, again.receiver_token) == tuple(saved.values())
    off = resolve(config_with(**{"sidecar.listen": "10.0.0.5:0", "sidecar.auth": "false"}), environ={})
    assert off.harness_key is None


def test_secrets_come_from_the_variables_the_config_names() -> None:
    config = config_with(
        **{"sidecar.harness_key_env": "MY_KEY", "sidecar.admin_token_env": "MY_ADMIN", "receiver.token_env": "MY_RX"}
    )
    topology = resolve(config, environ={"MY_KEY": "k", "MY_ADMIN": "a", "MY_RX": "r"})
    assert (topology.harness_key, topology.admin_token, topology.receiver_token) == ("k", "a", "r")
    assert topology.otlp_headers() == {"authorization": "Bearer r"}
    with pytest.raises(ConfigError, match="config key sidecar.harness_key_env: environment variable MY_KEY is not set"):
        resolve(config, environ={"MY_ADMIN": "a", "MY_RX": "r"})


def test_an_attached_sidecar_off_loopback_needs_its_admin_token() -> None:
    config = load_config(
        None, ["--sidecar.attach", '[{"url": "http://gpu1:8400"}]'], check_paths=False
    )
    with pytest.raises(ConfigError, match=r"config key sidecar.attach.0.admin_token_env: .*gpu1"):
        resolve(config, environ={})
    config = load_config(
        None,
        ["--sidecar.attach", '[{"url": "http://gpu1:8400", "admin_token_env": "T1", "harness_url": "https://gpu1.example", '
         '"upstreams": ["http://127.0.0.1:8000"]}]'],
        check_paths=False,
    )
    (target,) = resolve(config, environ={"T1": "secret"}).attached
    assert (target.admin_url, target.admin_token, target.harness_url) == ("http://gpu1:8400", "secret", "https://gpu1.example")
    assert target.upstreams == ["http://127.0.0.1:8000"]  # its node's engine server, as it reaches it


# --- in a training run ----------------------------------------------------------------------


def demo_tasks(n: int) -> list[dict[str, Any]]:
    from examples.demo.task import make_tasks

    return make_tasks(n, seed=3)


def test_off_loopback_harnesses_get_the_advertised_url_and_every_secret(tmp_path: Path, model_dir: Path) -> None:
    sidecar_port, receiver_port = free_port(), free_port()
    config = run_config(
        tmp_path, model_dir, "examples.demo.harness:run_episode",
        f"--sidecar.listen=0.0.0.0:{sidecar_port}", f"--sidecar.advertise_url=http://127.0.0.1:{sidecar_port}",
        f"--receiver.listen=0.0.0.0:{receiver_port}", f"--receiver.advertise_url=http://127.0.0.1:{receiver_port}",
    )  # fmt: skip
    probes: dict[str, int] = {}

    def on_step(step: int, metrics: dict[str, float]) -> None:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "k1"}], "max_tokens": 2}
        probes["sidecar_without_key"] = httpx.post(
            f"http://127.0.0.1:{sidecar_port}/v1/chat/completions", json=chat
        ).status_code
        probes["receiver_without_token"] = httpx.post(
            f"http://127.0.0.1:{receiver_port}/v1/traces", content=b"", headers={"content-type": "application/json"}
        ).status_code

    result = run_session(config, on_step)
    assert result.summary.steps == 1 and result.summary.failures == {}
    assert probes == {"sidecar_without_key": 401, "receiver_without_token": 401}
    out = Path(config.output_dir)
    secrets = json.loads((out / "auth.json").read_text())
    assert set(secrets) == {"harness_key", "admin_token", "receiver_token"}
    env_file = (out / "harness.env").read_text()
    assert f"OPENAI_BASE_URL='http://127.0.0.1:{sidecar_port}/v1'" in env_file
    assert f"OPENAI_API_KEY='{secrets['harness_key']}'" in env_file
    assert f"AGL_OTLP_HEADERS='authorization=Bearer {secrets['receiver_token']}'" in env_file
    for name in ("auth.json", "harness.env"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    with RolloutStore(out / "rollouts.db") as store:
        trained = [i for i in store.find("") if i.trained_step is not None]
        assert len(trained) == 4 and all(i.rewards >= 1 for i in trained)  # SDK rewards carried the token
    assert secrets["harness_key"] not in (out / "config.yaml").read_text()


@pytest.mark.parametrize(("mode", "switch"), [("sync", "drain"), ("collocated-async", "keep")])
def test_training_drives_the_sidecars_you_run(tmp_path: Path, model_dir: Path, mode: str, switch: str) -> None:
    """Two sidecars started outside `agl train` (one per engine node), attached by URL + admin token;
    a drain-free switch pauses and resumes both."""
    receiver_port = free_port()
    tokens = {"SIDECAR_A_TOKEN": "token-a", "SIDECAR_B_TOKEN": "token-b"}
    sidecars = [
        SidecarProcess(["http://127.0.0.1:9"], f"http://127.0.0.1:{receiver_port}", admin_token=token,
                       log_path=tmp_path / f"sidecar-{name}.log")
        for name, token in tokens.items()
    ]  # fmt: skip
    for sidecar in sidecars:
        sidecar.start()
    try:
        attach = [{"url": s.url, "admin_token_env": name} for s, name in zip(sidecars, tokens)]
        config = run_config(
            tmp_path, model_dir, "tests.loop.harnesses:calls",
            f"--loop.switch={switch}", f"--receiver.listen=127.0.0.1:{receiver_port}", "--sidecar.attach", json.dumps(attach),
            tasks=4, mode=mode, batch_rollouts=8, max_steps=2,
        )  # fmt: skip
        os.environ.update(tokens)
        try:
            result = run_session(config)
        finally:
            for name in tokens:
                os.environ.pop(name, None)
        assert result.summary.steps == 2 and result.summary.failures == {}
        states = [httpx.get(f"{s.url}/agl/v1/state", headers={"authorization": f"Bearer {t}"}).json()
                  for s, t in zip(sidecars, tokens.values())]  # fmt: skip
        assert all(state["counters"]["requests"] > 0 for state in states), states  # rollouts on both
        assert all(state["policy_version"] == 2 for state in states)  # both resumed at every update
        assert not (Path(config.output_dir) / "sidecar.log").exists()  # none of its own started
    finally:
        for sidecar in sidecars:
            sidecar.stop()


def test_an_unreachable_attached_sidecar_is_a_clear_error(tmp_path: Path, model_dir: Path) -> None:
    from agl_trainer.loop.ports import SidecarError

    unreachable = json.dumps([{"url": f"http://127.0.0.1:{free_port()}"}])
    config = run_config(tmp_path, model_dir, "tests.loop.harnesses:calls", "--sidecar.attach", unreachable)
    with pytest.raises(SidecarError, match=r"config key sidecar.attach.0: cannot reach the sidecar"):
        run_session(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def test_agl_receive_off_loopback_needs_a_token(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    from agl_trainer.cli import main

    monkeypatch.delenv("AGL_RECEIVER_TOKEN", raising=False)
    code = main(["receive", "--store", str(tmp_path / "t.db"), "--listen", "0.0.0.0:0"])
    err = capsys.readouterr().err
    assert code != 0 and "AGL_RECEIVER_TOKEN is not set" in err and "--no-token" in err, err
    assert not (tmp_path / "t.db").exists()  # refused before anything was created


async def test_a_graders_reward_reaches_a_sidecar_that_requires_the_harness_key(tmp_path: Path) -> None:
    from agl_trainer.loop.ports import SidecarError
    from agl_trainer.run.sidecar_client import SidecarAdmin
    from agl_testing.fake_vllm import FakeVLLM

    with FakeVLLM() as engine:
        sidecar = SidecarProcess([engine.base_url], "http://127.0.0.1:9", api_key="harness-secret",
                                 log_path=tmp_path / "log")  # fmt: skip
        assert "harness-secret" not in sidecar.command()  # by environment, not on the command line
        sidecar.start()
        try:
            async with SidecarAdmin(sidecar.url, sidecar.admin_token, harness_key="harness-secret") as admin:
                await admin.emit_reward("r-1", 1.0)
                assert (await admin.state()).paused is False  # admin calls still use the admin token
            async with SidecarAdmin(sidecar.url, sidecar.admin_token) as without_key:
                with pytest.raises(SidecarError, match="401"):
                    await without_key.emit_reward("r-1", 1.0)
        finally:
            sidecar.stop()


def test_agl_train_check_validates_the_addresses(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.cli import main

    base = make_config(tmp_path, model_dir, demo_tasks(2), "tests.loop.harnesses:calls")
    args = ["train", "--check", f"--tasks={base.tasks}", f"--model.path={base.model.path}",
            "--harness.function=tests.loop.harnesses:calls"]  # fmt: skip
    assert main(args) == 0
    assert main([*args, "--sidecar.listen=0.0.0.0:8400"]) != 0
    assert "config key sidecar.advertise_url: sidecar.listen 0.0.0.0:8400 is a wildcard" in capsys.readouterr().err


def test_the_older_sidecar_url_key_attaches_with_only_the_token_configured() -> None:
    (target,) = resolve(config_with(**{"sidecar.url": "http://127.0.0.1:8400"}), environ={}).attached
    assert target.admin_token is None  # a loopback sidecar without a token accepts loopback admin calls
    (target,) = resolve(config_with(**{"sidecar.url": "http://127.0.0.1:8400", "sidecar.admin_token": "t"}), environ={}).attached
    assert target.admin_token == "t"
    with pytest.raises(ConfigError, match="config key sidecar.admin_token_env: the sidecar at http://gpu1:8400"):
        resolve(config_with(**{"sidecar.url": "http://gpu1:8400"}), environ={})
