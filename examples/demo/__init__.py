"""The CPU demo: a two-call tool-use task a tiny model learns by RL after a short warm start.

task.py      the task: tasks, messages, the tool, the reward, the demo model's vocabulary
tasks.py     `python -m examples.demo.tasks --n 64 --seed 0 --out tasks.jsonl`
harness.py   the harness: a plain `openai` SDK script, also `examples.demo.harness:run_episode`
inprocess.py the same RL loop in one process with no pipeline (the overhead reference)
"""
