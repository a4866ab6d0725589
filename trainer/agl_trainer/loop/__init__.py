"""The training loop and what runs it.

- core.TrainingLoop: sync and collocated-async generation, pause/drain/train/sync/resume, staleness
- session.Session: one `agl train` run: receiver + store, engine, sidecar subprocess, runners,
  backend; Ctrl-C and --resume
- groups: the seeded task schedule and the launch journal; checkpoint: loop checkpoints and the
  trained.jsonl ledger; dataplane: the store + assembly as the loop sees them; ports: the protocols
"""
