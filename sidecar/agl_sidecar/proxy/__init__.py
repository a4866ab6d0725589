"""The hot path: one model call from the harness to the engine and back.

handler (forwarding, the engine's answer passed on), request (the harness's request typed and
rewritten), recording (token IDs and logprobs taken off the answer), wire (the typed wire shapes),
attribution (which rollout a call belongs to), gate (pause/resume), routing (which engine), fronts
(OpenAI or a translated protocol), litellm_upstream (hosted providers), inputs (value validation)."""
