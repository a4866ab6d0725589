"""The examples in examples/integrations run as written, through the real sidecar, and their reward
and call spans reach the OTLP receiver."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import agl
import pytest
from agl import semconv
from agl_sidecar.server import BackgroundSidecar

from tests.integrations.conftest import weather_upstream
from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink

ANSWER = "It is 18C in Paris."


def reward_and_calls(sink: OTLPSink, calls: int) -> tuple[float, list[str]]:
    assert agl.flush()
    spans = sink.wait_for(
        lambda s: (
            sum(x.name == "chat tiny" for x in s) >= calls and any(x.name == semconv.SPAN_REWARD for x in s)
        )
    )
    (reward,) = [s for s in spans if s.name == semconv.SPAN_REWARD]
    apis = [s.attributes[semconv.CALL_API] for s in spans if s.name == "chat tiny"]
    assert all(
        s.attributes[semconv.ROLLOUT_ID] == reward.attributes[semconv.ROLLOUT_ID]
        for s in spans
        if s.name == "chat tiny"
    )
    return reward.attributes[semconv.REWARD_VALUE], apis


@pytest.fixture
def weather_sidecar(sidecar_for: Callable[[str], BackgroundSidecar]) -> Iterator[str]:
    with weather_upstream() as upstream:
        yield sidecar_for(upstream.url).url


def test_anthropic_example(sink: OTLPSink, weather_sidecar: str) -> None:
    from examples.integrations import anthropic_sdk

    assert anthropic_sdk.run(weather_sidecar, "tiny", "Weather in Paris?") == ANSWER
    assert reward_and_calls(sink, 2) == (1.0, [semconv.API_ANTHROPIC_MESSAGES] * 2)


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_example(sink: OTLPSink, weather_sidecar: str, api: str) -> None:
    from examples.integrations import openai_agents

    assert openai_agents.run(weather_sidecar, "tiny", "Weather in Paris?", api) == ANSWER
    expected = semconv.API_RESPONSES if api == "responses" else semconv.API_CHAT_COMPLETIONS
    assert reward_and_calls(sink, 2) == (1.0, [expected] * 2)


def test_langgraph_example(sink: OTLPSink, weather_sidecar: str) -> None:
    from examples.integrations import langgraph_agent

    assert langgraph_agent.run(weather_sidecar, "tiny", "Weather in Paris?") == ANSWER
    assert reward_and_calls(sink, 2) == (1.0, [semconv.API_CHAT_COMPLETIONS] * 2)


def test_mini_swe_agent_example(
    sink: OTLPSink, tmp_path: Path, sidecar_for: Callable[[str], BackgroundSidecar]
) -> None:
    from examples.integrations import mini_swe_agent

    def act(body: dict, choice: int) -> str:
        done = any(m["role"] == "assistant" for m in body["messages"])
        command = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" if done else "echo fixed > answer.txt"
        return f"THOUGHT: go\n\n```mswea_bash_command\n{command}\n```"

    with FakeVLLM(reply=act) as fake:
        url = sidecar_for(fake.base_url).url
        outcome = mini_swe_agent.run(
            url, "tiny", str(tmp_path), "Write answer.txt", "test -f answer.txt", step_limit=4
        )
    assert outcome == {"exit_status": "Submitted", "passed": True}
    assert reward_and_calls(sink, 2) == (1.0, [semconv.API_CHAT_COMPLETIONS] * 2)
