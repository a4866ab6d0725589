"""The vLLM engine's GPU weight-sync path (weight_sync nccl / cuda_ipc, engines/vllm/sync.py) on the
wire, without a GPU: the fake vLLM server records the control calls and the transfer itself is a
recording stand-in for vLLM's trainer-side engines (tests/vllm/test_vllm_weight_transfer_gpu.py
runs the real one on a GPU). What is checked is the engine's part: every server paused, the tensors
sent to all of them at once, the prefix cache emptied and the version set on each, every server
resumed, a failure surfaced and a restarted server sent the latest weights again."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from agl_trainer.engines.vllm.engine import VLLMEngine, VLLMError
from agl_trainer.engines.vllm.transfer import GpuWeightTransfer, WeightTransferError
from agl_trainer.weights.update import WeightUpdate

from tests.vllm.test_engine_control import fake_config, read_events


class Sent:
    """What the engine handed the transfer: (urls, version, tensor names) per send; forgotten URLs."""

    def __init__(self) -> None:
        self.sends: list[tuple[list[str], int, list[str]]] = []
        self.forgotten: list[str] = []
        self.fail = False


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    record = Sent()

    def send(self: GpuWeightTransfer, urls: list[str], state_dict: Mapping[str, Any], version: int) -> None:
        if record.fail:
            raise WeightTransferError(f"weight transfer v{version} to {urls[0]} failed: NCCL timeout")
        record.sends.append((list(urls), version, sorted(state_dict)))

    monkeypatch.setattr(GpuWeightTransfer, "send", send)
    monkeypatch.setattr(GpuWeightTransfer, "forget", lambda self, url: record.forgotten.append(url))
    return record


def calls(tmp_path: Path) -> list[dict]:
    return [e for e in read_events(tmp_path / "events.jsonl") if not e["path"].startswith("<")]


STATE = {"model.embed_tokens.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2)}


def test_a_gpu_sync_pauses_sends_once_to_every_server_and_resumes(tmp_path: Path, sent: Sent) -> None:
    engine = VLLMEngine(fake_config(tmp_path, device="cuda", weight_sync="nccl", replicas=2))
    with engine:
        engine.update_weights(WeightUpdate(version=7, state_dict=STATE))
        urls = engine.urls
    assert sent.sends == [(urls, 7, sorted(STATE))]  # one send, every server in it
    paths = [c["path"] for c in calls(tmp_path)]
    assert paths == ["/pause"] * 2 + ["/reset_prefix_cache", "/update_weight_version"] * 2 + ["/resume"] * 2
    assert "/collective_rpc" not in paths  # no file and no worker load: the transfer carried the weights
    assert [c["body"] for c in calls(tmp_path) if c["path"] == "/update_weight_version"] == [{"new_version": "7"}] * 2
    assert engine.last_sync is not None and engine.last_sync.worker_results == [{"method": "nccl"}]
    assert engine.last_update_bytes == sum(t.numel() * t.element_size() for t in STATE.values())


def test_a_failed_transfer_is_a_vllm_error_and_every_server_resumes(tmp_path: Path, sent: Sent) -> None:
    engine = VLLMEngine(fake_config(tmp_path, device="cuda", weight_sync="cuda_ipc"))
    sent.fail = True
    with engine, pytest.raises(VLLMError, match="weight transfer v1 to .* failed: NCCL timeout"):
        engine.update_weights(WeightUpdate(version=1, state_dict=STATE))
    assert [c["path"] for c in calls(tmp_path)] == ["/pause", "/resume"]  # never left paused


def test_a_restarted_server_is_sent_the_latest_weights_alone(tmp_path: Path, sent: Sent) -> None:
    events = tmp_path / "events.jsonl"
    engine = VLLMEngine(fake_config(tmp_path, device="cuda", weight_sync="nccl", replicas=2))
    with engine:
        engine.update_weights(WeightUpdate(version=3, state_dict=STATE))
        victim = next(e["pid"] for e in read_events(events) if e["path"] == "<start>")
        (server,) = [s for s in engine._servers if s.process is not None and s.process.pid == victim]
        os.killpg(victim, signal.SIGKILL)
        server.process.wait(timeout=30)
        assert engine.ensure_alive() == [server.url]
    assert sent.forgotten == [server.url]  # its NCCL group died with it
    assert sent.sends[-1] == ([server.url], 3, sorted(STATE))
