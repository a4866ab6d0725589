"""A drained pause says what reached the receiver (issue 14, defect 5): spans in the sidecar's spool
are not delivered, and the trainer's client sees how many are missing. Real sidecar, real agl
receiver and store, real assembly."""

from __future__ import annotations

import asyncio

import httpx

from agl_trainer.assembly import assemble
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.run.sidecar_client import SidecarAdmin
from agl_trainer.store import RolloutStore
from tests.support.ports import free_port

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}


def _rollout(url: str, rollout: str, calls: int) -> None:
    for _ in range(calls):
        assert httpx.post(f"{url}/rollouts/{rollout}/v1/chat/completions", json=BODY).status_code == 200
    assert httpx.post(f"{url}/rollouts/{rollout}/reward", json={"value": 1.0}).status_code == 200
    assert httpx.post(f"{url}/rollouts/{rollout}/end", json={"status": "succeeded"}).status_code == 200


def test_a_drained_pause_reports_spans_the_receiver_has_not_acknowledged(fake, make_sidecar, tmp_path):
    port = free_port()  # the receiver starts only later, on the address the sidecar already sends to
    store_path = tmp_path / "rollouts.db"
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=f"http://127.0.0.1:{port}")
    _rollout(sidecar.url, "r1", 3)

    async def scenario() -> None:
        async with SidecarAdmin(sidecar.url, None) as admin:
            # The receiver is down: the drained calls' spans end up in the spool, not delivered.
            down = await admin.pause(drain=True, timeout_s=1.0)
            assert down.spans_flushed is False
            assert down.spans_in_spool == 5 and down.spans_undelivered == 5  # 3 calls, a reward, the end
            assert (await admin.resume()).paused is False
            with Receiver(store_path, ReceiverConfig(port=port, grpc_port=0)):
                up = await admin.pause(drain=True, timeout_s=20.0)
        assert up.spans_flushed is True and up.spans_undelivered == 0 and up.spans_failed == 0

    asyncio.run(scenario())
    with RolloutStore(store_path, grace_s=0.0) as store:
        assembly = assemble(store, ["r1"], record_drops=False)
    assert [r.rollout_id for r in assembly.rollouts] == ["r1"]
    assert assembly.rollouts[0].samples
