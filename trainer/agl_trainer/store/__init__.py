"""The rollout store: every span the trainer received, each rollout's end, and what was trained.

The training loop's whole API (one SQLite file, WAL mode; see rollout_store.py for durability):

    from agl_trainer.store import RolloutStore
    from agl_trainer.assembly import AssemblyConfig, assemble
    from agl_trainer.receiver import Receiver, ReceiverConfig

    receiver = Receiver(path, ReceiverConfig(port=0)).start()   # OTLP in; receiver.url for the sidecar
    store = RolloutStore(path, grace_s=2.0, rollout_timeout_s=600)  # its own connection, this thread

    store.mark_harness_exited(rollout_id, exit_code, cause=None, attempt=0)  # from the runner
    ready = store.ready_rollouts(mode="train", limit=None)   # complete, not trained, not dropped
    assembly = assemble(store, ready, AssemblyConfig(), tokenizer=None)
    assembly.rollouts  -> list[RolloutResult]   (TrainingBatch.from_rollouts(assembly.rollouts))
    assembly.report    -> AssemblyReport        (merge failures, truncations, drops)
    store.mark_trained([r.key for r in ready if ...], step)   # ids, (id, attempt) or RolloutKey
    store.mark_dropped([(key, reason), ...]) or mark_dropped(keys, reason)  # assemble() records its own
    store.completed(keys) -> set[RolloutKey]   # read-only: complete or due now, untrained, not dropped
    store.final_rewards(keys, name="reward") -> {key: value}   # records.final_reward, per rollout
    store.record_checkpoint(step, path); store.last_checkpoint(); store.last_step()
    store.stats()      -> StoreStats

A rollout is complete when its `agl.rollout` span arrived, or its harness exited, plus `grace_s`
for late spans, or `rollout_timeout_s` after its first span; its `end_cause` is a `Cause`: ok,
harness_error (failed rollout span, non-zero exit), infra_error, timeout, or cancelled. A restarted
trainer opens the same file: trained and dropped rollouts stay so, the rest are offered again.
"""

from agl_trainer.store.records import (
    CAUSES,
    Cause,
    RolloutData,
    RolloutInfo,
    RolloutKey,
    StoreStats,
)
from agl_trainer.store.rollout_store import RolloutStore, StoreError

__all__ = [
    "CAUSES",
    "Cause",
    "RolloutData",
    "RolloutInfo",
    "RolloutKey",
    "RolloutStore",
    "StoreError",
    "StoreStats",
]
