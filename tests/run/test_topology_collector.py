"""A real OpenTelemetry Collector (rotel) between the sidecar and the trainer's receiver, in a full
training run of the demo config: every span (the sidecar's calls, the SDK's rewards) goes through
the collector; the receiver is just the OTLP endpoint the collector exports to."""

from __future__ import annotations

from pathlib import Path

import pytest
from agl_trainer.config import load_config
from agl_trainer.store import RolloutStore

from tests.dataplane.processes import start_rotel
from tests.loop.test_loop import run_session, write_tasks
from tests.support.ports import free_port


@pytest.mark.slow
def test_training_with_spans_through_an_external_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.demo.model import build_demo_model
    from examples.demo.task import make_tasks

    model = build_demo_model(tmp_path / "tiny", seed=0)
    receiver_port = free_port()
    monkeypatch.setenv("RECEIVER_TOKEN", "collector-to-receiver-secret")  # the receiver demands it of the collector
    # the receiver starts later, in the session: the collector retries until it listens
    collector, collector_port, _ = start_rotel(
        tmp_path, f"http://127.0.0.1:{receiver_port}", "http",
        "--otlp-exporter-custom-headers", "authorization=Bearer collector-to-receiver-secret",
    )  # fmt: skip
    try:
        tasks = write_tasks(tmp_path / "tasks.jsonl", make_tasks(16, seed=1))
        collector_url = f"http://127.0.0.1:{collector_port}"
        config = load_config(
            "examples/demo/config.yaml",
            [
                f"--tasks={tasks}", f"--output_dir={tmp_path / 'run'}", f"--model.path={model}",
                "--harness.workers=1", "--loop.batch_rollouts=32", "--loop.concurrency=32", "--loop.max_steps=3",
                "--loop.checkpoint_every=3", "--loop.completion_grace_s=1.0", "--val_tasks=null", "--loop.val_every=0",
                f"--receiver.listen=127.0.0.1:{receiver_port}", "--receiver.auth=true",
                "--receiver.token_env=RECEIVER_TOKEN",
                # Senders use the collector: the sidecar for its call spans, harnesses' SDK for rewards.
                f"--receiver.advertise_url={collector_url}", f"--sidecar.otlp_endpoint={collector_url}",
            ],
        )  # fmt: skip
        result = run_session(config)
    finally:
        collector.terminate()
        collector.wait(timeout=10)
    assert result.summary.steps == 3 and result.summary.failures == {}
    assert all(row["rollouts/trained"] > 0 for row in result.summary.history)
    with RolloutStore(tmp_path / "run" / "rollouts.db") as store:
        trained = [i for i in store.find("") if i.trained_step is not None]
        assert len(trained) >= 64
        assert all(i.calls == 2 and i.rewards >= 1 for i in trained)  # calls and rewards both came through
    assert "Traceback" not in (tmp_path / "run" / "sidecar.log").read_text()
