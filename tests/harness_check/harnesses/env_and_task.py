"""A tiny harness that makes one call and prints what the runner's environment told it."""

import json
import os

import openai

task = json.loads(os.environ["AGL_TASK"])
openai.OpenAI().chat.completions.create(model="tiny", messages=[{"role": "user", "content": task["question"]}])
print("GREETING", os.environ["GREETING"], "TASK", task["id"], "ROLLOUT", os.environ["AGL_ROLLOUT_ID"], "CWD", os.getcwd())
print("ANTHROPIC_BASE_URL", os.environ["ANTHROPIC_BASE_URL"], "OPENAI_BASE_URL", os.environ["OPENAI_BASE_URL"])
