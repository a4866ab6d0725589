"""Sidecars that share a spool directory (issue 14, defect 6): each endpoint's spans reach only that
endpoint, two live sidecars never replay the same files, and a dead sidecar's spool is adopted."""

from __future__ import annotations

import signal
import time

import httpx

from tests.sidecar.sidecar_process import SidecarProcess
from tests.support.otlp_sink import OTLPSink
from tests.support.waiting import wait_until

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}


def _calls(url: str, prefix: str, count: int) -> None:
    with httpx.Client(timeout=30) as client:
        for i in range(count):
            assert client.post(f"{url}/rollouts/{prefix}{i:02d}/v1/chat/completions", json=BODY).status_code == 200


def _wait_spooled(url: str, count: int) -> None:
    def spooled() -> bool:
        return httpx.get(f"{url}/agl/v1/state").json()["counters"]["spans_in_spool"] >= count

    wait_until(spooled, f"{count} spans in {url}'s spool", timeout=15)


def _names(sink: OTLPSink) -> list[str]:
    return sorted(str(s.rollout_id) for s in sink.spans)


def test_two_sidecars_sharing_a_spool_each_deliver_only_their_own_spans(fake, tmp_path):
    spool = str(tmp_path / "shared-spool")
    env = {"AGL_SIDECAR_EXPORT_INTERVAL_S": "0.05"}
    with OTLPSink() as sink_a, OTLPSink() as sink_b:
        sink_a.fail_with = sink_b.fail_with = 503  # both endpoints down: both sidecars spool
        a = SidecarProcess("--upstream", fake.base_url, "--otlp-endpoint", sink_a.endpoint, "--spool-dir", spool,
                           log_path=str(tmp_path / "a.log"), env=env)
        b = SidecarProcess("--upstream", fake.base_url, "--otlp-endpoint", sink_b.endpoint, "--spool-dir", spool,
                           log_path=str(tmp_path / "b.log"), env=env)
        with a, b:
            _calls(a.url, "a", 8)
            _calls(b.url, "b", 8)
            _wait_spooled(a.url, 8)
            _wait_spooled(b.url, 8)
            sink_a.fail_with = sink_b.fail_with = None
            sink_a.wait_for(lambda spans: len(spans) >= 8)
            sink_b.wait_for(lambda spans: len(spans) >= 8)
            time.sleep(0.5)  # time for a wrong delivery to show
        assert _names(sink_a) == [f"a{i:02d}" for i in range(8)]
        assert _names(sink_b) == [f"b{i:02d}" for i in range(8)]


def test_two_live_sidecars_for_one_endpoint_replay_apart_and_dead_ones_spools_are_adopted(fake, tmp_path):
    spool = str(tmp_path / "shared-spool")
    env = {"AGL_SIDECAR_EXPORT_INTERVAL_S": "0.05"}
    with OTLPSink() as sink:
        sink.fail_with = 503
        args = ("--upstream", fake.base_url, "--otlp-endpoint", sink.endpoint, "--spool-dir", spool)
        a = SidecarProcess(*args, log_path=str(tmp_path / "a.log"), env=env).start()
        b = SidecarProcess(*args, log_path=str(tmp_path / "b.log"), env=env).start()
        try:
            _calls(a.url, "a", 6)
            _calls(b.url, "b", 6)
            _wait_spooled(a.url, 6)
            _wait_spooled(b.url, 6)
            sink.fail_with = None  # both replay, each its own slot: nothing arrives twice
            sink.wait_for(lambda spans: len(spans) >= 12)
            sink.fail_with = 503
            _calls(a.url, "c", 5)
            _calls(b.url, "d", 5)
            _wait_spooled(a.url, 5)
            _wait_spooled(b.url, 5)
            a.signal(signal.SIGKILL)  # both die with spans in their slots
            b.signal(signal.SIGKILL)
        finally:
            a.kill()
            b.kill()
        sink.fail_with = None
        with SidecarProcess(*args, log_path=str(tmp_path / "c.log"), env=env) as c:  # takes one slot, adopts the other
            sink.wait_for(lambda spans: len(spans) >= 22)
            time.sleep(0.5)  # time for a duplicate to show
            assert "adopted" in c.output()
        names = _names(sink)
    expected = [f"{p}{i:02d}" for p, n in (("a", 6), ("b", 6), ("c", 5), ("d", 5)) for i in range(n)]
    assert names == sorted(expected)  # every span once
