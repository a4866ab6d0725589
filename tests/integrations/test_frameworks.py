"""The real frameworks from PyPI (anthropic, openai-agents, langchain-openai + langgraph,
mini-swe-agent), set up with agl_integrations inside `agl.rollout()`, through the real agl sidecar
to a faithful engine (the fake vLLM; for tool calls a scripted upstream in vLLM's tool-call wire
shape). Every call's span, at a real OTLP receiver, is attributed to the rollout, sits under the
rollout's span in its trace (the helpers' URL prefix and headers at work) and holds the engine's
token IDs; the harness's reward arrives too."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import agl
import pytest
from agl import semconv
from agl_integrations import sidecar_endpoint
from agl_sidecar.server import BackgroundSidecar

from tests.integrations.conftest import weather_upstream
from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink, ReceivedSpan


def rollout_spans(
    sink: OTLPSink, rollout_id: str, calls: int
) -> tuple[ReceivedSpan, ReceivedSpan, list[ReceivedSpan]]:
    """The rollout's span, its reward span, and its `calls` call spans (in call order)."""
    assert agl.flush()

    def ours(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.attributes.get(semconv.ROLLOUT_ID) == rollout_id]

    spans = ours(sink.wait_for(lambda s: len(ours(s)) >= calls + 2))
    (rollout,) = [s for s in spans if s.name == semconv.SPAN_ROLLOUT]
    (reward,) = [s for s in spans if s.name == semconv.SPAN_REWARD]
    call_spans = sorted(
        (s for s in spans if s.name == "chat tiny"), key=lambda s: s.attributes[semconv.CALL_SEQ]
    )
    assert len(call_spans) == calls
    return rollout, reward, call_spans


def assert_attributed(rollout: ReceivedSpan, call_spans: list[ReceivedSpan], api: str) -> None:
    """Every call span is in the rollout's trace, under its span, and holds the engine's tokens."""
    assert len({span.attributes[semconv.CALL_SEQ] for span in call_spans}) == len(call_spans)  # each numbered once
    for span in call_spans:
        assert span.attributes[semconv.CALL_API] == api
        assert span.trace_id == rollout.trace_id and span.parent_span_id == rollout.span_id
        assert span.attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_FROM_ENGINE
        assert span.attributes[semconv.COMPLETION_TOKEN_IDS] and span.attributes[semconv.PROMPT_LENGTH] > 0


def test_endpoint_needs_a_url_and_prefixes_the_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="OPENAI_BASE_URL"):
        sidecar_endpoint()
    assert sidecar_endpoint("http://h:1").base_url == "http://h:1/v1"
    rollout = agl.rollout(rollout_id="r9", attempt=2)
    endpoint = sidecar_endpoint("http://h:1/", rollout=rollout)
    assert (
        endpoint.base_url == "http://h:1/rollouts/r9/attempts/2/v1"
        and endpoint.root_url == "http://h:1/rollouts/r9/attempts/2"
    )
    assert endpoint.headers[semconv.HEADER_ROLLOUT_ID] == "r9"
    # a runner's OPENAI_BASE_URL already carries the prefix: kept as is
    monkeypatch.setenv("OPENAI_BASE_URL", "http://h:1/rollouts/r9/v1")
    assert sidecar_endpoint(rollout=rollout).base_url == "http://h:1/rollouts/r9/v1"


def test_anthropic_sdk(
    sink: OTLPSink, engine: FakeVLLM, sidecar_for: Callable[[str], BackgroundSidecar]
) -> None:
    from agl_integrations.anthropic_sdk import anthropic_client

    sidecar = sidecar_for(engine.base_url)
    with agl.rollout(task_id="t-anthropic") as rollout:
        client = anthropic_client(sidecar.url)
        message = client.messages.create(
            model="tiny", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]
        )
        with client.messages.stream(
            model="tiny", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]
        ) as s:
            streamed = s.get_final_message()
        agl.emit_reward(1.0)
    assert (
        message.content[0].text and streamed.content[0].text == message.content[0].text
    )  # deterministic engine
    span, reward, calls = rollout_spans(sink, rollout.rollout_id, calls=2)
    assert_attributed(span, calls, semconv.API_ANTHROPIC_MESSAGES)
    assert [c.attributes[semconv.GEN_AI_RESPONSE_ID] for c in calls] == [message.id, streamed.id]
    assert reward.attributes[semconv.REWARD_VALUE] == 1.0


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk(sink: OTLPSink, api: str, sidecar_for: Callable[[str], BackgroundSidecar]) -> None:
    from agents import Agent, Runner, function_tool
    from agl_integrations.openai_agents import run_config

    asked: list[str] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather of a city."""
        asked.append(city)
        return f"18 {unit}"

    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather])
    with weather_upstream() as upstream, agl.rollout(task_id="t-agents") as rollout:
        sidecar = sidecar_for(upstream.url)
        result = Runner.run_sync(
            agent, "Weather in Paris?", run_config=run_config("tiny", sidecar.url, api=api)
        )
        agl.emit_reward(1.0 if "18C" in result.final_output else 0.0)
    assert asked == ["Paris"] and result.final_output == "It is 18C in Paris."
    span, reward, calls = rollout_spans(sink, rollout.rollout_id, calls=2)
    assert_attributed(
        span, calls, semconv.API_RESPONSES if api == "responses" else semconv.API_CHAT_COMPLETIONS
    )
    second = upstream.chat_requests[1]["messages"]
    assert second[0] == {"role": "system", "content": "Answer with the weather."}
    assert second[-1]["role"] == "tool" and "18 celsius" in json.dumps(second[-1]["content"])
    assert calls[0].attributes[semconv.COMPLETION_TOKEN_IDS] == [40, 41, 42, 43, 2]  # the tool call's tokens
    assert reward.attributes[semconv.REWARD_VALUE] == 1.0


def test_langgraph_react_agent(sink: OTLPSink, sidecar_for: Callable[[str], BackgroundSidecar]) -> None:
    from agl_integrations.langchain import chat_model
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather of a city."""
        return f"18 {unit} in {city}"

    with weather_upstream() as upstream, agl.rollout(task_id="t-langgraph") as rollout:
        sidecar = sidecar_for(upstream.url)
        graph = create_react_agent(chat_model("tiny", sidecar.url), [get_weather])
        state = graph.invoke({"messages": [("user", "Weather in Paris?")]})
        agl.emit_reward(0.5)
    assert state["messages"][-1].content == "It is 18C in Paris."
    assert any(getattr(m, "content", "") == "18 celsius in Paris" for m in state["messages"])
    span, reward, calls = rollout_spans(sink, rollout.rollout_id, calls=2)
    assert_attributed(span, calls, semconv.API_CHAT_COMPLETIONS)
    assert upstream.chat_requests[0]["tools"][0]["function"]["name"] == "get_weather"
    assert reward.attributes[semconv.REWARD_VALUE] == 0.5


def run_mini_swe_agent(
    client: str, sink: OTLPSink, work: Path, sidecar_for: Callable[[str], BackgroundSidecar]
) -> tuple[dict, list[dict], dict]:
    """mini-swe-agent's text-based agent with `client`, scripted by the engine: writes a file, then
    submits. Returns the agent's result, the requests the engine received, and the saved trajectory."""
    import yaml
    from agl_integrations.mini_swe_agent import swe_model
    from minisweagent import config as swe_config
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment

    def act(body: dict, choice: int) -> str:
        step = sum(1 for m in body["messages"] if m["role"] == "assistant")
        command = (
            "echo fixed > answer.txt"
            if step == 0
            else "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat answer.txt"
        )
        return f"THOUGHT: step {step}\n\n```mswea_bash_command\n{command}\n```"

    agent_config = yaml.safe_load((Path(swe_config.__file__).parent / "mini_textbased.yaml").read_text())[
        "agent"
    ]
    agent_config.update(step_limit=5, cost_limit=0)
    work.mkdir()
    with FakeVLLM(reply=act) as fake, agl.rollout(task_id="t-swe") as rollout:
        sidecar = sidecar_for(fake.base_url)
        model = swe_model("tiny", sidecar.url, client=client, model_kwargs={"max_tokens": 256})
        agent = DefaultAgent(model, LocalEnvironment(cwd=str(work)), **agent_config)
        result = agent.run("Write 'fixed' to answer.txt")
        agl.emit_reward(1.0 if (work / "answer.txt").read_text().strip() == "fixed" else 0.0)
    assert result["exit_status"] == "Submitted" and result["submission"].strip() == "fixed"
    span, reward, calls = rollout_spans(sink, rollout.rollout_id, calls=2)
    assert_attributed(span, calls, semconv.API_CHAT_COMPLETIONS)
    assert reward.attributes[semconv.REWARD_VALUE] == 1.0
    trajectory = json.loads(json.dumps(agent.serialize()))  # what agent.save writes
    return result, fake.requests, trajectory


@pytest.mark.parametrize("client", ["litellm", "openai"])
def test_mini_swe_agent(
    client: str, sink: OTLPSink, tmp_path: Path, sidecar_for: Callable[[str], BackgroundSidecar]
) -> None:
    run_mini_swe_agent(client, sink, tmp_path / "repo", sidecar_for)


def test_mini_swe_agent_over_the_openai_sdk_sends_what_litellm_sends(
    sink: OTLPSink, tmp_path: Path, sidecar_for: Callable[[str], BackgroundSidecar]
) -> None:
    """client="openai" spares litellm's import; the engine must not be able to tell: the same requests
    (messages, sampling, what the sidecar adds), the same conversation in the trajectory."""
    _, by_litellm, litellm_trajectory = run_mini_swe_agent("litellm", sink, tmp_path / "a", sidecar_for)
    _, by_openai, openai_trajectory = run_mini_swe_agent("openai", sink, tmp_path / "b", sidecar_for)
    assert len(by_openai) == len(by_litellm) == 2
    for request in by_litellm:  # litellm echoes its own `provider_specific_fields` into the assistant turns it
        for message in request["messages"]:  # sends back: not a chat-template field, the engine ignores it
            message.pop("provider_specific_fields", None)
    assert by_openai == by_litellm

    def conversation(trajectory: dict) -> list[tuple[str, str]]:
        return [(m["role"], m["content"]) for m in trajectory["messages"]]

    assert conversation(openai_trajectory) == conversation(litellm_trajectory)
    assert openai_trajectory["trajectory_format"] == "mini-swe-agent-1.1"
    assert openai_trajectory["info"]["config"]["model_type"].endswith("SidecarTextModel")
    assert [m["extra"]["actions"] for m in openai_trajectory["messages"] if m["role"] == "assistant"] == [
        m["extra"]["actions"] for m in litellm_trajectory["messages"] if m["role"] == "assistant"
    ]


def test_mini_swe_agent_over_the_openai_sdk_keeps_a_malformed_reply_and_refuses_a_bad_setting(
    sink: OTLPSink, tmp_path: Path, sidecar_for: Callable[[str], BackgroundSidecar]
) -> None:
    """A reply with no bash block is mini-swe-agent's format error, response kept (its contract); the
    API key stays out of what a trajectory saves; a client that does not exist, or the tool-calling
    model over the SDK, is refused by name."""
    from agl_integrations.mini_swe_agent import swe_model
    from minisweagent.exceptions import FormatError

    with FakeVLLM(reply=lambda body, choice: "no block here") as fake, agl.rollout(task_id="t-bad"):
        model = swe_model("tiny", sidecar_for(fake.base_url).url, client="openai", model_kwargs={"max_tokens": 16})
        with pytest.raises(FormatError) as raised:
            model.query([{"role": "user", "content": "hi", "extra": {"not": "sent"}}])
    (message,) = raised.value.messages
    assert message["extra"]["n_actions"] == 0 and message["extra"]["response"]["choices"][0]["message"]["content"] == "no block here"
    assert fake.requests[0]["messages"] == [{"role": "user", "content": "hi"}]
    from agl_integrations.mini_swe_agent import SidecarTextModel

    keyed = SidecarTextModel(model_name="tiny", model_kwargs={"api_base": "http://127.0.0.1:9/v1", "api_key": "sk-not-for-files"})
    assert "sk-not-for-files" not in json.dumps(keyed.serialize())  # a saved trajectory does not carry the key
    with pytest.raises(ValueError, match="client 'httpx'"):
        swe_model("tiny", "http://127.0.0.1:9", client="httpx")
    with pytest.raises(ValueError, match="text-based model only"):
        swe_model("tiny", "http://127.0.0.1:9", client="openai", textbased=False)


def test_the_sidecar_text_model_keeps_mini_swe_agents_own_defaults():
    """SidecarTextModelConfig restates mini-swe-agent's text-based config (importing that would import
    litellm, which the OpenAI-SDK client exists to avoid): the action regex, the format-error and
    observation templates must stay the installed version's, or the same agent would parse and render
    differently behind the sidecar's client. An upgrade that changes them fails here."""
    from agl_integrations.mini_swe_agent import SidecarTextModelConfig
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModelConfig

    ours, theirs = SidecarTextModelConfig.model_fields, LitellmTextbasedModelConfig.model_fields
    assert set(ours) <= set(theirs), f"fields mini-swe-agent does not have: {set(ours) - set(theirs)}"
    for name, field in ours.items():
        if not field.is_required():
            assert field.get_default() == theirs[name].get_default(), name
