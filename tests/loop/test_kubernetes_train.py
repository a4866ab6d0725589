"""`agl train` with harness.runner=kubernetes, end to end: every rollout a Job on the stand-in API
server, whose simulated kubelet runs the pod's command here with the pod's environment (the demo
harness as a program), so the sidecar's advertised address, the secrets and the SDK's rewards are
what a real pod would get."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from agl_trainer.config import load_config
from agl_trainer.runners.kubernetes_manifest import check_job_manifest
from agl_trainer.store import RolloutStore
from tests.loop.test_loop import model_dir, run_session, write_tasks  # noqa: F401 (model_dir: a fixture)
from tests.support.fake_kube import FakeKube
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def this_machines_address() -> str:
    """An address of this machine that is not loopback (what a pod would dial)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        return probe.getsockname()[0]


@pytest.mark.slow
def test_training_runs_each_rollout_as_a_job(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from examples.demo.task import make_tasks

    host = this_machines_address()
    assert not host.startswith("127."), "this test needs an interface other than loopback"
    sidecar_port, receiver_port = free_port(), free_port()
    monkeypatch.setenv("TEST_HARNESS_KEY", "harness-key-in-a-secret")
    monkeypatch.setenv("TEST_RECEIVER_TOKEN", "receiver-token-in-a-secret")
    fake = FakeKube().start()
    fake.scenario = lambda job: "exec"
    fake.exec_env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    fake.secrets["agl-harness"] = {
        "key": "harness-key-in-a-secret",
        "otlp-headers": "authorization=Bearer receiver-token-in-a-secret",
    }
    secret_env = {
        "OPENAI_API_KEY": "agl-harness/key", "ANTHROPIC_API_KEY": "agl-harness/key",
        "AGL_OTLP_HEADERS": "agl-harness/otlp-headers",
    }  # fmt: skip
    try:
        config = load_config(
            None,
            [
                f"--tasks={write_tasks(tmp_path / 'tasks.jsonl', make_tasks(2, seed=3))}",
                f"--output_dir={tmp_path / 'run'}", f"--model.path={model_dir}",
                "--harness.runner=kubernetes", "--harness.image=ghcr.io/me/demo-harness:1",
                f"--harness.command={json.dumps([sys.executable, str(ROOT / 'examples/demo/harness.py')])}",
                f"--harness.cwd={ROOT}", "--harness.timeout_s=120",
                f"--harness.kubernetes.kubeconfig={fake.write_kubeconfig(tmp_path / 'kubeconfig')}",
                f"--harness.kubernetes.secret_env={json.dumps(secret_env)}",
                "--harness.kubernetes.resources={requests: {cpu: 100m, memory: 256Mi}}",
                "--loop.mode=sync", "--loop.batch_rollouts=4", "--loop.group_size=2", "--loop.max_steps=1",
                "--loop.completion_grace_s=0.2",
                f"--sidecar.listen=0.0.0.0:{sidecar_port}", f"--sidecar.advertise_url=http://{host}:{sidecar_port}",
                "--sidecar.harness_key_env=TEST_HARNESS_KEY",
                f"--receiver.listen=0.0.0.0:{receiver_port}", f"--receiver.advertise_url=http://{host}:{receiver_port}",
                "--receiver.token_env=TEST_RECEIVER_TOKEN",
            ],
        )  # fmt: skip
        result = run_session(config)
    finally:
        fake.stop()
    assert result.summary.steps == 1 and result.summary.failures == {}, fake.logs
    assert len(fake.created) == 4
    for manifest in fake.created:
        check_job_manifest(manifest)
        text = json.dumps(manifest)
        assert "harness-key-in-a-secret" not in text and "receiver-token-in-a-secret" not in text  # secrets stay secret
        env = {e["name"]: e.get("value") for e in manifest["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["OPENAI_BASE_URL"].startswith(f"http://{host}:{sidecar_port}/rollouts/")
        assert env["AGL_OTLP_ENDPOINT"] == f"http://{host}:{receiver_port}"
    with RolloutStore(Path(config.output_dir) / "rollouts.db") as store:
        trained = [i for i in store.find("") if i.trained_step is not None]
    assert len(trained) == 4 and all(i.rewards >= 1 for i in trained)  # the pods' SDK rewards got through
