"""Span export: zero spans lost across an endpoint outage (spool + replay, also across a restart),
through a real collector (rotel), and gRPC."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from agl import semconv
from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar

from tests.support.otlp_sink import OTLPSink
from tests.support.required import requires
from tests.support.waiting import wait_until

MESSAGES = [{"role": "user", "content": "go"}]
from tests.dataplane.processes import ROTEL, start_rotel


def _calls(url: str, count: int, rollout: str = "x") -> None:
    for _ in range(count):
        r = httpx.post(f"{url}/rollouts/{rollout}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == 200


def test_endpoint_down_then_up_loses_no_span(fake, make_sidecar, tmp_path):
    with OTLPSink(fail_with=503) as sink:
        sidecar = make_sidecar(
            upstream=[fake.base_url], otlp_endpoint=sink.endpoint, spool_dir=str(tmp_path / "s"), otlp_compression="gzip"
        )
        counters = sidecar.sidecar.exporter.counters
        _calls(sidecar.url, 30)
        wait_until(lambda: counters.spans_spooled >= 30, "30 spans spooled")
        assert sink.spans == [] and list((tmp_path / "s").rglob("*.otlp.gz"))
        sink.fail_with = None  # the endpoint comes back
        spans = sink.wait_for(lambda spans: len(spans) >= 30, timeout=20)
        assert len({s.attributes[semconv.CALL_SEQ] for s in spans}) == 30
        wait_until(lambda: counters.spool_files == 0, "the spool replayed")
        assert counters.spans_failed == 0 and counters.spans_replayed == 30
        assert not list((tmp_path / "s").rglob("*.otlp.gz"))
        _calls(sidecar.url, 1)  # live export works again
        sink.wait_for(lambda spans: len(spans) >= 31)


def test_spool_survives_a_restart(fake, tmp_path):
    spool = str(tmp_path / "spool")
    with OTLPSink(fail_with=503) as sink:
        settings = {"upstream": [fake.base_url], "listen": "127.0.0.1:0", "spool_dir": spool,
                    "export_interval_s": 0.05, "otlp_endpoint": sink.endpoint}
        with BackgroundSidecar(build(settings)) as sidecar:
            _calls(sidecar.url, 5)
        # Stopped while the endpoint was down: the spans wait on disk.
        assert list(Path(spool).rglob("*.otlp.gz"))
        sink.fail_with = None
        with BackgroundSidecar(build(settings)):
            spans = sink.wait_for(lambda spans: len(spans) >= 5, timeout=20)
    assert len(spans) == 5 and not list(Path(spool).rglob("*.otlp.gz"))


def test_big_spans_are_batched_below_the_byte_limit(make_sidecar, otlp_sink):
    from agl_testing.fake_vllm import FakeVLLM, chat_prompt_ids

    with FakeVLLM() as fake:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint, export_batch_bytes=64 * 1024,
                               export_interval_s=1.0)
        long = [{"role": "user", "content": "x" * 20000}]  # ~20k prompt tokens, ~120 KB per span
        for i in range(6):
            httpx.post(f"{sidecar.url}/rollouts/b{i}/v1/chat/completions", json={"model": "tiny", "messages": long})
        spans = otlp_sink.wait_for(lambda spans: len(spans) >= 6)
        assert all(s.attributes[semconv.PROMPT_TOKEN_IDS] == chat_prompt_ids(long) for s in spans)
        assert otlp_sink.requests == 6  # one span per request: two would exceed 64 KiB


@requires(ROTEL.exists(), "rotel-agent binary not installed (pip install rotel)")  # under CI=true: fails if missing
def test_spans_reach_a_real_collector(fake, make_sidecar, otlp_sink, tmp_path):
    collector, http_port, grpc_port = start_rotel(tmp_path, otlp_sink.endpoint, "http")
    try:
        via_http = make_sidecar(
            upstream=[fake.base_url], otlp_endpoint=f"http://127.0.0.1:{http_port}", otlp_compression="gzip"
        )
        via_grpc = make_sidecar(
            upstream=[fake.base_url], otlp_endpoint=f"http://127.0.0.1:{grpc_port}", otlp_protocol="grpc"
        )
        _calls(via_http.url, 2, rollout="via-http")
        _calls(via_grpc.url, 2, rollout="via-grpc")
        spans = otlp_sink.wait_for(lambda spans: len(spans) >= 4, timeout=30)
    finally:
        collector.terminate()
        collector.wait(10)
    engine = httpx.post(
        fake.base_url + "/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "return_token_ids": True},
    ).json()
    assert sorted(s.attributes[semconv.ROLLOUT_ID] for s in spans) == ["via-grpc"] * 2 + ["via-http"] * 2
    for span in spans:
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] == engine["prompt_token_ids"]
        assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == engine["choices"][0]["token_ids"]
        assert span.resource["service.name"] == "agl-sidecar"


def test_no_endpoint_counts_spans_as_failed(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    _calls(sidecar.url, 2)
    state = httpx.get(sidecar.url + "/agl/v1/state").json()
    assert state["counters"]["spans_failed"] == 2 and state["counters"]["spans_exported"] == 0
    assert os.environ.get("AGL_SIDECAR_OTLP_ENDPOINT") is None


def test_spans_on_their_way_to_the_spool_stay_counted_as_pending(fake, make_sidecar, tmp_path):
    """The state's counters account for every span at every moment, also while a batch taken from the
    queue is being compressed and written to the spool (in the export thread): a caller waiting for
    "nothing pending" must not see them gone from every count (CI's full-disk test once did)."""
    import asyncio
    import threading

    with OTLPSink(fail_with=503) as sink:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=sink.endpoint, spool_dir=str(tmp_path / "s"))
        exporter = sidecar.sidecar.exporter
        counters = exporter.counters
        _calls(sidecar.url, 1)
        wait_until(lambda: counters.spans_in_spool == 1, "the endpoint found down, the first span spooled")
        gate = threading.Event()
        compress = exporter._gzip

        async def held_compress(data: bytes) -> bytes:  # the next spool write waits for the gate
            await asyncio.to_thread(gate.wait)
            return await compress(data)

        exporter._gzip = held_compress
        try:
            _calls(sidecar.url, 5)
            wait_until(  # the export cycle took some of them and waits in the compression
                lambda: counters.spans_submitted == 6 and len(exporter._pending) < 5, "spans taken for the spool"
            )

            def accounted() -> int:
                state = httpx.get(f"{sidecar.url}/agl/v1/state").json()["counters"]
                return sum(state[k] for k in ("spans_pending", "spans_sending", "spans_in_spool", "spans_failed"))

            assert accounted() == 6
        finally:
            gate.set()
        wait_until(lambda: counters.spans_in_spool == 6, "all 6 in the spool")
        assert counters.spans_pending == 0 and accounted() == 6


def test_auto_compression_on_loopback_gzips_only_requests_of_prompts_sent_before(fake, make_sidecar):
    with OTLPSink() as sink:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=sink.endpoint)  # otlp_compression: auto
        assert sidecar.sidecar.exporter.compress == "repeats"

        def call(text: str, spans_then: int) -> None:
            messages = [{"role": "user", "content": text}]
            reply = httpx.post(f"{sidecar.url}/rollouts/r/v1/chat/completions", json={"model": "tiny", "messages": messages})
            assert reply.status_code == 200
            sink.wait_for(lambda spans: len(spans) >= spans_then)  # one span a request

        call("first " + "words never sent " * 400, 1)
        call("second " + "words never sent " * 400, 2)
        repeated = "the same long context " * 400  # ~8.8k token IDs, ~40 KB of span
        for sent in range(4):
            call(repeated, 3 + sent)
    # Fresh prompts and the first send of the repeated one go raw (compressing them would only cost
    # CPU on loopback); its later sends are mostly the kept deflate stream of a prompt sent before.
    assert sink.encodings == ["identity", "identity", "identity", "gzip", "gzip", "gzip"]
    prompts = [span.attributes[semconv.PROMPT_TOKEN_IDS] for span in sink.spans[2:]]
    assert len(prompts) == 4 and all(ids == prompts[0] for ids in prompts) and len(prompts[0]) > 8000


def test_auto_compression_on_loopback_sends_small_repeated_prompts_raw(fake, make_sidecar):
    # A prompt of ~2k token IDs sent again: copying its kept stream costs more than its ~10 KB raw.
    with OTLPSink() as sink:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=sink.endpoint)
        for sent in range(3):
            messages = [{"role": "user", "content": "a short context " * 130}]
            reply = httpx.post(f"{sidecar.url}/rollouts/r/v1/chat/completions", json={"model": "tiny", "messages": messages})
            assert reply.status_code == 200
            sink.wait_for(lambda spans, n=sent + 1: len(spans) >= n)
    assert sink.encodings == ["identity"] * 3
