"""An OpenAI Agents SDK agent with a tool, through the agl sidecar (Responses API by default).

python examples/integrations/openai_agents.py --sidecar http://127.0.0.1:8080 --model my-model [--api chat]
"""

from __future__ import annotations

import argparse
import json

import agl
from agents import Agent, Runner, function_tool
from agl_integrations.openai_agents import run_config


@function_tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"18C and sunny in {city}"


def run(sidecar: str, model: str, question: str, api: str = "responses") -> str:
    agent = Agent(name="weather", instructions="Answer with the weather; use the tool.", tools=[get_weather])
    with agl.rollout(task_id="weather"):
        result = Runner.run_sync(agent, question, run_config=run_config(model, sidecar, api=api))
        agl.emit_reward(1.0 if "18C" in str(result.final_output) else 0.0)
    return str(result.final_output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", required=True, help="the model name the engine serves")
    parser.add_argument("--api", choices=["responses", "chat"], default="responses")
    parser.add_argument("--question", default="What is the weather in Paris?")
    args = parser.parse_args(argv)
    print(json.dumps({"answer": run(args.sidecar, args.model, args.question, args.api)}))
    agl.flush()


if __name__ == "__main__":
    main()
