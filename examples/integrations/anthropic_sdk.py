"""A Claude-style agent loop on an open model: the Anthropic SDK, tools, through the agl sidecar.

python examples/integrations/anthropic_sdk.py --sidecar http://127.0.0.1:8080 --model my-model
"""

from __future__ import annotations

import argparse
import json

import agl
from agl_integrations.anthropic_sdk import anthropic_client

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def get_weather(city: str, **_: object) -> str:
    return f"18C and sunny in {city}"


def run(sidecar: str, model: str, question: str, max_turns: int = 4) -> str:
    with agl.rollout(task_id="weather"):
        client = anthropic_client(sidecar)
        messages: list[dict] = [{"role": "user", "content": question}]
        for _ in range(max_turns):
            reply = client.messages.create(
                model=model, max_tokens=256, tools=[WEATHER_TOOL], messages=messages
            )
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
            )
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                break
            results = [
                {"type": "tool_result", "tool_use_id": c.id, "content": get_weather(**c.input)} for c in calls
            ]
            messages.append({"role": "user", "content": results})
        answer = "".join(b.text for b in reply.content if b.type == "text")
        agl.emit_reward(1.0 if "18C" in answer else 0.0)
    return answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", required=True, help="the model name the engine serves")
    parser.add_argument("--question", default="What is the weather in Paris?")
    args = parser.parse_args(argv)
    print(json.dumps({"answer": run(args.sidecar, args.model, args.question)}))
    agl.flush()


if __name__ == "__main__":
    main()
