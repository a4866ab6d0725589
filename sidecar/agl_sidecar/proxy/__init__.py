"""The hot path: one model call from the harness to the engine and back.

handler (forwarding, the engine's answer passed on), parts (what the proxy works with), request (the
harness's request typed and rewritten, the engine's Authorization), recording (token IDs and logprobs
taken off the answer), sse (an event stream split into whole events), gate (pause/resume), routing
(which engine), fronts (OpenAI or a translated protocol), litellm_upstream (hosted providers),
failures (how a call that did not complete is recorded). The call itself lives in calls/."""
