"""What the training loop needs from an inference engine, whatever serves the model.

An engine serves an OpenAI-compatible API with vLLM's wire format (token IDs and logprobs on
request) at one or more base URLs, which the loop hands to the sidecar as upstreams. Between
rollouts the loop pushes new weights into it in place, without a restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from agl_trainer.weights.update import AdapterState, WeightUpdate


class PolicySource(Protocol):
    """What a training backend hands an engine (the loop's Backend has these)."""

    uses_lora: bool

    def adapter_for_engine(self) -> AdapterState: ...

    def state_dict_for_engine(self) -> Mapping[str, Any]: ...


def policy_update(backend: PolicySource, engine: InferenceEngine, version: int) -> WeightUpdate:
    """The backend's policy as `engine` takes it: a LoRA run sends the adapter alone to an engine that
    serves a base with adapters (merged weights would become its base, and every later adapter would
    stack on them: after a resume too), else the whole (merged) model."""
    if backend.uses_lora and engine.accepts_adapters:
        return WeightUpdate(version, adapter=backend.adapter_for_engine())
    return WeightUpdate(version, state_dict=backend.state_dict_for_engine())


class InferenceEngine(Protocol):
    # update_weights takes a WeightUpdate that carries an adapter (LoRA: adapter-only sync)
    accepts_adapters: bool
    # a call frozen across a keep switch continues over the old weights' KV of its prefix (True), or
    # its prefix is recomputed by the new weights (False: vLLM's switch_kv recompute)
    keeps_kv_at_switch: bool

    @property
    def urls(self) -> list[str]:
        """Base URLs (scheme://host:port, no /v1) of the engine's OpenAI-compatible servers."""
        ...

    def start(self) -> None:
        """Start (or attach to) the servers and return once every one answers its health check."""
        ...

    def stop(self) -> None:
        """Stop what start() started; safe to call twice."""
        ...

    def update_weights(self, update: WeightUpdate) -> float:
        """Load new weights in place (generation is paused by the caller) and drop any cache
        computed with the old weights. Returns the seconds it took."""
        ...

    def freeze(self) -> dict[str, int]:
        """Hold the requests in flight where they are, tokens and KV cache kept, until thaw() (a
        drain-free policy switch, loop.switch: keep). Returns, by response id (`<id>-<i>` for choice
        i > 0), the completion tokens each had generated."""
        ...

    def thaw(self) -> None:
        """Continue the frozen requests under the weights loaded meanwhile."""
        ...

    def sleep(self) -> bool:
        """Free the accelerator memory the engine holds, for training (collocated on a GPU); the next
        update_weights() wakes it. False where there is nothing to free or the engine cannot sleep."""
        ...
