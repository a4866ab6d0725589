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


def test_a_flush_delivers_the_finished_calls_spans_and_holds_no_call(fake, make_sidecar, tmp_path):
    """POST /agl/v1/flush: a validation round or `agl eval` reads finished rollouts while other calls go
    on. Nothing is held: a call made while the endpoint is down is answered; the flush says the spans
    are undelivered, and once the receiver is up another flush delivers them all."""
    port = free_port()
    store_path = tmp_path / "rollouts.db"
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=f"http://127.0.0.1:{port}")
    _rollout(sidecar.url, "r1", 2)

    async def scenario() -> None:
        async with SidecarAdmin(sidecar.url, None) as admin:
            down = await admin.flush(timeout_s=1.0)
            assert down.spans_flushed is False and down.paused is False
            assert down.spans_in_spool == 4 and down.spans_undelivered == 4  # 2 calls, a reward, the end
            with Receiver(store_path, ReceiverConfig(port=port, grpc_port=0)):
                _rollout(sidecar.url, "r2", 1)  # not held: the sidecar was never paused
                up = await admin.flush(timeout_s=20.0)
                assert up.spans_flushed is True and up.spans_undelivered == 0 and up.paused is False
                with RolloutStore(store_path, grace_s=0.0) as store:  # read as the receiver runs
                    assembly = assemble(store, ["r1", "r2"], record_drops=False)
                assert sorted(r.rollout_id for r in assembly.rollouts) == ["r1", "r2"]
                # every call is in the store: r1's two calls (the same prompt twice: two samples) and r2's one
                assert [len(r.samples) for r in sorted(assembly.rollouts, key=lambda r: r.rollout_id)] == [2, 1]

    asyncio.run(scenario())


def test_a_flush_refuses_a_bad_timeout_with_the_expected_shape(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    for body in ({"timeout_s": 0}, {"timeout_s": "soon"}, {"wait": True}):
        answer = httpx.post(f"{sidecar.url}/agl/v1/flush", json=body)
        assert answer.status_code == 400 and "timeout_s" in answer.json()["error"], (body, answer.text)
