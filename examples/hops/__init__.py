"""Chained lookups by a main agent that delegates each hop to a sub-agent: tree-shaped rollouts of
1 to 27 samples (sub-agents, retries, compactions) that a tiny model learns by RL on a CPU.

README.md    what the example is and how to run it
task.py      the task and the agent program (one definition for the harness and the in-process player)
harness.py   the harness: the `openai` SDK through the sidecar, one trace span per agent thread
model.py     the hops model (the demo's tiny model with the word `main`)
tokens.py    messages -> token ids as the chat template renders them; samples as assembly makes them
play.py      rollouts played in-process with batched sampling (warm-start eval, bench/normalization.py)
prepare.py   the starting model (built, warm-started on a few demonstrations, measured) and the task files
run.py       `python -m examples.hops.run`: prepare, `agl train examples/hops/config.yaml` per seed, plot
config.yaml  the RL run's configuration
"""
