"""A full disk (RLIMIT_FSIZE on the sidecar process) and a full spool: the sidecar keeps answering the harness and
counts every span it could not keep; nothing is silently gone, and the spans it did keep arrive."""

from __future__ import annotations

import random

import httpx

from tests.sidecar.sidecar_process import SidecarProcess
from tests.support.otlp_sink import OTLPSink
from tests.support.waiting import wait_until

CALLS = 30
LONG = [{"role": "user", "content": random.Random(0).randbytes(3000).hex()}]  # a ~40 KB span, ~8 KB gzipped


def test_a_full_disk_costs_only_the_spans_that_did_not_fit_and_every_one_is_counted(fake, tmp_path):
    with OTLPSink() as sink:
        sink.fail_with = 503
        args = ("--upstream", fake.base_url, "--otlp-endpoint", sink.endpoint, "--spool-dir", str(tmp_path / "spool"),
                "--durable-spans")
        # The spool holds 16 KiB, and no file of the process may grow past 64 KiB (the durable span
        # log hits that): both run out while the endpoint is down.
        env = {"AGL_SIDECAR_EXPORT_INTERVAL_S": "0.05", "AGL_SIDECAR_SPOOL_MAX_BYTES": str(16 * 1024)}
        with SidecarProcess(*args, log_path=str(tmp_path / "s.log"), env=env, file_size_limit=64 * 1024) as sidecar:
            with httpx.Client(timeout=30) as client:
                for i in range(CALLS):
                    r = client.post(f"{sidecar.url}/rollouts/f{i:02d}/v1/chat/completions",
                                    json={"model": "tiny", "messages": LONG})
                    assert r.status_code == 200  # the harness is served whatever the disk does
                counters: dict[str, int] = {}

                def settled() -> bool:
                    counters.update(client.get(f"{sidecar.url}/agl/v1/state").json()["counters"])
                    return counters["spans_pending"] == counters["spans_sending"] == counters["spans_building"] == 0

                wait_until(settled, "no span pending, sending or being built", timeout=15)
                metrics = client.get(f"{sidecar.url}/metrics").text
            assert counters["durable_write_failures"] > 0 and counters["spans_failed"] > 0
            assert counters["spans_in_spool"] + counters["spans_failed"] == CALLS
            assert f"agl_sidecar_spans_failed_total {counters['spans_failed']}" in metrics
            kept = counters["spans_in_spool"]
            sink.fail_with = None
            sink.wait_for(lambda spans: len(spans) >= kept)
        assert len(sink.spans) == kept
