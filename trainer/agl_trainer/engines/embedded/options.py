"""The embedded engine's settings a user sets: `engine.options` when `engine.name: embedded`.

Typed once here (msgspec, no torch: reading a config stays light): the config's loader checks types
and ranges as the YAML is read, `agl train --help` lists them, and the engine takes the struct as it
is (`EmbeddedEngineConfig.options`). What comes from other sections (the model's path and name,
`engine.max_batch`) is not an option.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from agl_trainer.engines.device_step import MAX_DEVICE_STEP_MS, check_device_step_ms


def _doc(text: str, **constraints: Any) -> Any:
    return msgspec.Meta(description=text, **constraints)


class EmbeddedOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`engine.options` of the embedded engine (engine.py)."""

    host: Annotated[str, _doc("address the engine's HTTP server listens on")] = "127.0.0.1"
    port: Annotated[int, _doc("its port (0: a free one)", ge=0, le=65535)] = 0
    max_model_len: Annotated[
        Annotated[int, msgspec.Meta(ge=16)] | None,
        _doc("longest prompt + completion in tokens (null: the model's max_position_embeddings, at most 4096)"),
    ] = None
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], _doc("the served weights' dtype")] = "float32"
    # Requests, the batch's bookkeeping and sampling stay on the CPU; each step moves its inputs over
    # and the last position's logits back.
    device: Annotated[
        str, _doc("where the model runs: cpu, cuda or cuda:N", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    ] = "cpu"
    # 1 by default: on a tiny model intra-op threads cost more in synchronisation than they save, and
    # on a loaded 2-core machine they were 8x slower (2.3 s vs 0.28 s for a 12-token request).
    torch_threads: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        _doc("process-wide torch.set_num_threads (null: leave torch's setting, for bigger models)"),
    ] = 1
    # Models a GPU's per-token latency where the tiny model's CPU step would be too cheap to show what
    # waiting for the longest generation costs (the CPU is free meanwhile).
    device_step_ms: Annotated[
        float,
        _doc("benches: each batched step also waits this long, as a host waits on an accelerator (0: off)",
             ge=0, le=MAX_DEVICE_STEP_MS),
    ] = 0.0
    fault_skip_weight_load: Annotated[
        bool,
        _doc("fault injection for the canary's tests: an update takes the new version but keeps the old weights"),
    ] = False

    def __post_init__(self) -> None:  # the range again for options built in code (msgspec checks a config's)
        check_device_step_ms(self.device_step_ms)
