"""The training loop: the algorithm of a run, written against the protocols in ports.py.

- core.TrainingLoop: one loop for both rollout sources: ready batch, assemble, train, checkpoint, publish
- live.LiveRollouts: rollouts launched and generated now (sync and collocated-async, pause/drain or
  freeze, weight sync, the canary, the staleness bound); inflight.InFlight: its rollouts in flight
- stored.StoredRollouts: rollouts read from a store (`agl train --from-store`); stored_checks: what
  the model cannot take
- groups: the seeded task schedule and the launch journal; checkpoint: loop checkpoints and the
  trained.jsonl ledger; report: what a step reports; validation, canary: what checks it

What builds the parts and starts the processes is in agl_trainer.run.
"""
