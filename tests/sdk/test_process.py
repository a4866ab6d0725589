"""The SDK inside a harness process: its own OpenTelemetry pipeline, exit right after a reward,
an unreachable collector, and what `import agl` costs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from agl import semconv
from tests.support.otlp_sink import OTLPSink


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OTEL_"))}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_harness_exiting_right_after_emit_reward_loses_nothing(otlp_sink: OTLPSink) -> None:
    result = run_python(
        """
        import agl
        agl.emit_reward(0.5)
        """,
        env={semconv.ENV_OTLP_ENDPOINT: otlp_sink.endpoint, semconv.ENV_ROLLOUT_ID: "exit-now"},
    )
    assert result.returncode == 0, result.stderr
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) == 1)
    assert span.name == semconv.SPAN_REWARD
    assert span.attributes[semconv.ROLLOUT_ID] == "exit-now"
    assert span.attributes[semconv.REWARD_VALUE] == 0.5


def test_standard_otel_endpoint_variable_is_honoured(otlp_sink: OTLPSink) -> None:
    result = run_python(
        """
        import agl
        with agl.rollout(rollout_id="std-env"):
            agl.emit_reward(1)
        """,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint},
    )
    assert result.returncode == 0, result.stderr
    spans = otlp_sink.wait_for(lambda spans: len(spans) == 2)
    assert {s.name for s in spans} == {semconv.SPAN_ROLLOUT, semconv.SPAN_REWARD}


def test_a_harness_with_its_own_tracer_provider_gets_agl_spans_in_its_pipeline(otlp_sink: OTLPSink) -> None:
    result = run_python(
        f"""
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({{"service.name": "my-harness"}}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint="{otlp_sink.endpoint}/v1/traces")))
        trace.set_tracer_provider(provider)

        import agl
        agl.init(endpoint="http://127.0.0.1:9")  # ignored: the harness's provider wins
        tracer = trace.get_tracer("harness")
        with tracer.start_as_current_span("episode"):
            with agl.rollout(rollout_id="own-pipeline"):
                agl.emit_reward(1.0)
        assert trace.get_tracer_provider() is provider, "agl must not replace the global provider"
        provider.shutdown()
        """
    )
    assert result.returncode == 0, result.stderr
    spans = otlp_sink.wait_for(lambda spans: len(spans) == 3)
    by_name = {span.name: span for span in spans}
    assert by_name[semconv.SPAN_ROLLOUT].resource["service.name"] == "my-harness"
    assert by_name[semconv.SPAN_ROLLOUT].parent_span_id == by_name["episode"].span_id
    assert by_name[semconv.SPAN_REWARD].parent_span_id == by_name[semconv.SPAN_ROLLOUT].span_id


def test_an_unreachable_collector_is_reported_with_the_span_count() -> None:
    result = run_python(
        """
        import agl
        agl.emit_reward(1.0, rollout_id="nobody-listens")
        agl.emit_reward(2.0, rollout_id="nobody-listens")
        """,
        env={semconv.ENV_OTLP_ENDPOINT: "http://127.0.0.1:9", semconv.ENV_EXIT_FLUSH_TIMEOUT: "3"},
    )
    assert result.returncode == 0
    assert "could not deliver 2 span(s)" in result.stderr, result.stderr


def test_no_endpoint_at_all_is_said_not_silent() -> None:
    result = run_python("import agl; agl.emit_reward(1.0, rollout_id='r')")
    assert result.returncode == 0
    assert "no OTLP endpoint configured" in result.stderr


def test_import_agl_pulls_no_heavy_dependency() -> None:
    result = run_python(
        """
        import sys
        import agl
        heavy = [m for m in ("torch", "litellm", "verl", "transformers", "opentelemetry.sdk") if m in sys.modules]
        print(heavy)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
