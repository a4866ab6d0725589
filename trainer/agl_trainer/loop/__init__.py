"""The training loop: the algorithm of a run, written against the protocols in ports.py.

- core.TrainingLoop: sync and collocated-async generation, pause/drain/train/sync/resume, staleness
- inflight.InFlight: the rollouts in flight, when complete groups make a batch
- groups: the seeded task schedule and the launch journal; checkpoint: loop checkpoints and the
  trained.jsonl ledger; report: what a step reports; validation, canary, agreement_log: what checks it

What builds the parts and starts the processes is in agl_trainer.run.
"""
