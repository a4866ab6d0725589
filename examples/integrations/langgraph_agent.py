"""A LangGraph ReAct agent (LangChain's ChatOpenAI) with a tool, through the agl sidecar.

python examples/integrations/langgraph_agent.py --sidecar http://127.0.0.1:8080 --model my-model
"""

from __future__ import annotations

import argparse
import json

import agl
from agl_integrations.langchain import chat_model
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"18C and sunny in {city}"


def run(sidecar: str, model: str, question: str) -> str:
    with agl.rollout(task_id="weather"):
        graph = create_react_agent(chat_model(model, sidecar), [get_weather])
        state = graph.invoke({"messages": [("user", question)]}, {"recursion_limit": 8})
        answer = str(state["messages"][-1].content)
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
