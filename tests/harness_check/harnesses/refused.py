"""A tiny harness that sends one good call and one the sidecar refuses (a known field with a wrong
type: a 400 naming it). It does not stop at the refusal, as many harnesses do not."""

import os

import httpx

url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
messages = [{"role": "user", "content": "Hi."}]
good = httpx.post(url, json={"model": "tiny", "messages": messages}, timeout=120)
bad = httpx.post(url, json={"model": "tiny", "messages": messages, "max_tokens": "many"}, timeout=120)
print(good.status_code, bad.status_code, bad.text[:300])
