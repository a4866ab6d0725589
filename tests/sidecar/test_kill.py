"""A killed sidecar and the spans of calls it already answered (issue 14, defect 10).

Without durable mode a span waits in memory between the call's answer and the endpoint's
acknowledgement: SIGTERM sends or spools it, SIGKILL loses it (the control case shows the test sees
that). With --durable-spans it is on disk before the harness gets the last byte: SIGKILL loses none."""

from __future__ import annotations

import signal

import httpx
import pytest
from agl import semconv

from tests.sidecar.sidecar_process import SidecarProcess
from tests.support.otlp_sink import OTLPSink

CALLS = 12


def _calls(url: str, stream: bool) -> None:
    """CALLS calls, then a reward and an end for the first rollout (spans too)."""
    with httpx.Client(timeout=30) as client:
        for i in range(CALLS):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": stream}
            r = client.post(f"{url}/rollouts/k{i:02d}/v1/chat/completions", json=body)
            assert r.status_code == 200
            if stream:
                assert "[DONE]" in r.text
        assert client.post(f"{url}/rollouts/k00/reward", json={"value": 1.0}).status_code == 200
        assert client.post(f"{url}/rollouts/k00/end", json={"status": "succeeded"}).status_code == 200


@pytest.mark.parametrize(
    ("durable", "sig", "stream", "kept"),
    [
        (True, signal.SIGKILL, False, CALLS + 2),
        (True, signal.SIGKILL, True, CALLS + 2),
        (False, signal.SIGTERM, False, CALLS + 2),
        (False, signal.SIGKILL, False, 0),  # control: the window durable mode closes
    ],
    ids=["durable-sigkill-unary", "durable-sigkill-stream", "sigterm", "control-sigkill-loses"],
)
def test_spans_of_answered_calls_survive_the_sidecar(fake, tmp_path, durable, sig, stream, kept):
    with OTLPSink() as sink:
        args = ["--upstream", fake.base_url, "--otlp-endpoint", sink.endpoint, "--spool-dir", str(tmp_path / "spool")]
        if durable:
            args.append("--durable-spans")
        # A long export interval keeps answered calls' spans in memory: the window under test.
        env = {"AGL_SIDECAR_EXPORT_INTERVAL_S": "60"}
        sidecar = SidecarProcess(*args, log_path=str(tmp_path / "sidecar.log"), env=env).start()
        try:
            _calls(sidecar.url, stream)
            assert sidecar.signal(sig) is not None
        finally:
            sidecar.kill()
        with SidecarProcess(*args, log_path=str(tmp_path / "sidecar.log"), env={"AGL_SIDECAR_EXPORT_INTERVAL_S": "0.05"}):
            if kept:
                sink.wait_for(lambda spans: len(spans) >= kept, timeout=20)
            else:
                import time

                time.sleep(1.0)  # a restarted sidecar replays at once; give it time to show it has nothing
        spans = {(str(s.rollout_id), s.name) for s in sink.spans}
        # Every call here got its answer before the kill: each recovered span says so (its delivery
        # marker followed it into the log), none is set aside as "delivery unknown".
        assert not [s.rollout_id for s in sink.spans if semconv.CALL_DELIVERY in s.attributes]
    assert len(spans) == kept and len(sink.spans) >= kept
    assert {rollout for rollout, _ in spans} <= {f"k{i:02d}" for i in range(CALLS)}
