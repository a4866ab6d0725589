"""mini-swe-agent (the coding agent of the SWE-bench result) through the sidecar.

    with agl.rollout(task_id=instance_id):
        agent = DefaultAgent(swe_model("my-model", "http://127.0.0.1:8080"), LocalEnvironment(), **agent_config)
        result = agent.run(task)
        agl.emit_reward(1.0 if tests_pass() else 0.0)

mini-swe-agent calls models through litellm; the sidecar is an OpenAI-compatible server to it
(litellm's `hosted_vllm/` provider), so the engine's token IDs are recorded as for any chat call.
`client="openai"` swaps litellm for `SidecarTextModel`, the same text-based agent model over the
OpenAI SDK: importing litellm costs about 4 s of CPU in every harness process, which a runner that
starts one process per rollout pays per rollout (bench/harness_start.py); the requests the engine
receives are the same (tests/integrations/test_frameworks.py).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any, Literal, get_args

from agl import Rollout
from pydantic import BaseModel

from agl_integrations.endpoint import sidecar_endpoint

Client = Literal["litellm", "openai"]
CLIENTS: tuple[str, ...] = get_args(Client)
# What a chat message sends: the rest of a response's message (refusal, annotations, audio, nulls) stays out.
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
# How servers say a prompt outgrew the context: vLLM and OpenAI "maximum context length", OpenAI's
# code context_length_exceeded, litellm's and others' "context window", Anthropic's "prompt is too long".
_CONTEXT_OVERFLOW = re.compile(r"maximum context length|context[_ ]length[_ ]exceeded|context window|prompt is too long", re.I)


def swe_model(
    model: str,
    sidecar_url: str | None = None,
    *,
    textbased: bool = True,
    client: Client = "litellm",
    rollout: Rollout | None = None,
    **config: Any,
) -> Any:
    """A mini-swe-agent model for the current rollout. `textbased=True` parses bash blocks from the
    text (models without a tool-call parser in vLLM); False uses its tool-calling model. `client`:
    mini-swe-agent's litellm models, or "openai" (`SidecarTextModel`, text-based only) to spare each
    harness process litellm's import."""
    if client not in CLIENTS:
        raise ValueError(f"client {client!r}: expected one of {', '.join(CLIENTS)}")
    endpoint = sidecar_endpoint(sidecar_url, rollout)
    model_kwargs = {
        "api_base": endpoint.base_url,
        "api_key": endpoint.api_key,
        "extra_headers": endpoint.headers,
    }
    model_kwargs.update(config.pop("model_kwargs", {}))
    if client == "openai":
        if not textbased:
            raise ValueError("client 'openai' has the text-based model only: use textbased=True or client='litellm'")
        return SidecarTextModel(model_name=model.removeprefix("hosted_vllm/").removeprefix("openai/"),
                                model_kwargs=model_kwargs, **config)  # fmt: skip
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    name = model if model.startswith(("hosted_vllm/", "openai/")) else f"hosted_vllm/{model}"
    config.setdefault("cost_tracking", "ignore_errors")  # open models have no price in litellm's table
    cls = LitellmTextbasedModel if textbased else LitellmModel
    return cls(model_name=name, model_kwargs=model_kwargs, **config)


def context_overflow(error: BaseException) -> bool:
    """Whether a model call failed because the conversation no longer fits the model's context: an
    ending of the agent's own (as its step limit is), not a failed call to retry. Either client's
    error: litellm's ContextWindowExceededError, or a 400 (openai.BadRequestError, of which litellm's
    errors are subclasses) that says so. Neither library is imported here for the check."""
    litellm = sys.modules.get("litellm")
    if litellm is not None and isinstance(error, litellm.exceptions.ContextWindowExceededError):
        return True
    openai = sys.modules.get("openai")
    if openai is None or not isinstance(error, openai.BadRequestError):
        return False
    return getattr(error, "code", None) == "context_length_exceeded" or bool(_CONTEXT_OVERFLOW.search(str(error)))


class SidecarTextModelConfig(BaseModel):
    """mini-swe-agent's LitellmTextbasedModelConfig, less what only litellm reads (registry, cache control, cost).
    Restated, not imported: its module imports litellm. A test holds the defaults to the installed version's."""

    model_name: str
    model_kwargs: dict[str, Any] = {}
    action_regex: str = r"```mswea_bash_command\s*\n(.*?)\n```"
    format_error_template: str = (
        "Please always provide EXACTLY ONE action in triple backticks, found {{actions|length}} actions."
    )
    observation_template: str = (
        "{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
        "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
    )
    multimodal_regex: str = ""


class SidecarTextModel:
    """mini-swe-agent's text-based model (its `LitellmTextbasedModel`: one bash block parsed from the
    reply, observations rendered by its template) calling an OpenAI-compatible server through the
    OpenAI SDK instead of litellm. Same agent, same requests, same trajectory format; no cost (an
    open model behind the sidecar has no price), so `cost_limit` does not apply."""

    def __init__(self, **kwargs: Any) -> None:
        import openai

        kwargs.pop("cost_tracking", None)  # litellm's setting: nothing is priced here
        self.config = SidecarTextModelConfig(**kwargs)
        request = dict(self.config.model_kwargs)
        base_url, api_key = request.pop("api_base", None), request.pop("api_key", None)
        self._headers = request.pop("extra_headers", None) or {}
        self._request = request
        # mini-swe-agent's retry loop retries (as with litellm): the client itself does not.
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0)
        self.abort_exceptions: list[type[BaseException]] = [
            openai.BadRequestError, openai.AuthenticationError, openai.PermissionDeniedError,
            openai.NotFoundError, openai.UnprocessableEntityError, KeyboardInterrupt,
        ]  # fmt: skip

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        from minisweagent.exceptions import FormatError
        from minisweagent.models import GLOBAL_MODEL_STATS
        from minisweagent.models.utils.actions_text import parse_regex_actions
        from minisweagent.models.utils.retry import retry

        sent = [{k: m[k] for k in _MESSAGE_KEYS if m.get(k) is not None} for m in messages]
        for attempt in retry(logger=logging.getLogger("agl.mini_swe_agent"), abort_exceptions=self.abort_exceptions):
            with attempt:
                response = self._client.chat.completions.create(
                    model=self.config.model_name, messages=sent, extra_headers=self._headers, **(self._request | kwargs)
                )
        GLOBAL_MODEL_STATS.add(0.0)
        choice = response.choices[0]
        try:
            actions = parse_regex_actions(
                choice.message.content or "",
                action_regex=self.config.action_regex,
                format_error_template=self.config.format_error_template,
                template_kwargs={"finish_reason": choice.finish_reason},
            )
        except FormatError as error:  # mini-swe-agent's contract: the response is kept on a format error too
            error.messages[0]["extra"].update(cost=0.0, response=response.model_dump(mode="json"))
            raise
        message = choice.message.model_dump(mode="json", exclude_none=True)
        message["extra"] = {"actions": actions, "response": response.model_dump(mode="json"), "cost": 0.0,
                            "timestamp": time.time()}  # fmt: skip
        return message

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        from minisweagent.models.utils.openai_multimodal import expand_multimodal_content

        return expand_multimodal_content(kwargs, pattern=self.config.multimodal_regex)

    def format_observation_messages(
        self, message: dict[str, Any], outputs: list[dict[str, Any]], template_vars: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        from minisweagent.models.utils.actions_text import format_observation_messages

        return format_observation_messages(
            outputs,
            observation_template=self.config.observation_template,
            template_vars=template_vars,
            multimodal_regex=self.config.multimodal_regex,
        )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict[str, Any]:
        """What a saved trajectory records of the model: its config, the API key left out (the
        sidecar's token from OPENAI_API_KEY has no place in a file users share)."""
        model = self.config.model_dump(mode="json")
        if "api_key" in model["model_kwargs"]:
            model["model_kwargs"]["api_key"] = "<redacted>"
        model_type = f"{type(self).__module__}.{type(self).__name__}"
        return {"info": {"config": {"model": model, "model_type": model_type}}}
