"""The CPU demo: a two-call tool-use task a tiny model learns by RL after a short warm start.

task.py      the task: tasks, messages, the tool, the reward, the demo model's vocabulary
tasks.py     `python -m examples.demo.tasks --n 64 --seed 0 --out tasks.jsonl`
harness.py   the harness: a plain `openai` SDK script, also `examples.demo.harness:run_episode`
inprocess.py the same RL loop in one process with no pipeline (the overhead reference)
model.py     the tiny demo model (agl_trainer.models.tiny with the task's vocabulary)
episodes.py  episodes played in-process, batched (evaluation, warm-start demonstrations)
sampling.py  batched sampling in one process, no server (what episodes.py plays with)
warmstart.py the supervised warm start before RL (its own phase)
prepare.py   the demo's starting model: built, warm-started, both measured
run.py       the demo end to end (`agl demo`, `make demo`: agl_trainer/cli/demo.py is its command line)
config.yaml  the RL run's configuration
"""
