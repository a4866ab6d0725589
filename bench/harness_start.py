"""Benchmark: what starting a mini-swe-agent harness process costs, by the client its model calls with.

    python bench/harness_start.py [--processes 16] [--repeats 3]

agl's runner starts the harness once per rollout, so whatever a harness process does before its first
model call is paid per rollout. Each measured process does what examples/swe/harness.py does up to
and including its first call: imports agl and mini-swe-agent's agent and environment, builds the
model with `agl_integrations.mini_swe_agent.swe_model(client=...)`, and sends one chat call to a
local engine double (agl_testing's fake vLLM, in this process); then it exits. Two clients:

  litellm  the reference: mini-swe-agent's own LitellmTextbasedModel (imports litellm)
  openai   SidecarTextModel: the same text-based model over the OpenAI SDK

Printed per client: CPU seconds a process (user + system, from the kernel's accounting of the
children), the wall time of one process alone, and the wall time of `processes` started together (as
the runner starts a step's rollouts); then the ratios litellm / openai. Best of `repeats`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIENTS = ("litellm", "openai")
# One harness process up to its first call (examples/swe/harness.py's imports and model, one query).
PROCESS = """
import sys
import agl
from agl_integrations.mini_swe_agent import swe_model
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
model = swe_model("tiny", sys.argv[1], client=sys.argv[2], model_kwargs={"max_tokens": 128})
message = model.query([{"role": "user", "content": "Fix the bug."}])
assert message["extra"]["actions"], message
"""


@dataclass
class Measured:
    client: str
    cpu_s: float  # per process
    alone_s: float
    together_s: float


def run_processes(count: int, url: str, client: str) -> tuple[float, float]:
    """Start `count` processes at once; (wall seconds until all exited, CPU seconds per process)."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(ROOT)}
    before = os.times()
    started = time.perf_counter()
    children = [
        subprocess.Popen([sys.executable, "-c", PROCESS, url, client], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)  # fmt: skip
        for _ in range(count)
    ]
    for child in children:
        _, err = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"harness_start: a {client} process failed:\n{err.decode()[-2000:]}")
    wall = time.perf_counter() - started
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu / count


def measure(client: str, url: str, processes: int, repeats: int) -> Measured:
    alone = [run_processes(1, url, client) for _ in range(repeats)]
    together = [run_processes(processes, url, client) for _ in range(repeats)]
    cpu = min(c for _, c in alone + together)
    return Measured(client, cpu, min(w for w, _ in alone), min(w for w, _ in together))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=16, help="processes started together (a step's rollouts)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs of each measurement")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.repeats < 1:
        parser.error("--processes and --repeats must be >= 1")
    from agl_testing.fake_vllm import FakeVLLM

    reply = "THOUGHT: look.\n\n```mswea_bash_command\nls\n```"
    with FakeVLLM(reply=lambda body, choice: reply) as engine:
        results = {client: measure(client, engine.base_url, args.processes, args.repeats) for client in CLIENTS}
    print(f"harness start (imports, model, one call), {os.cpu_count()} CPUs, best of {args.repeats}:")
    print(f"{'client':8} {'CPU s a process':>16} {'one alone, s':>13} {f'{args.processes} together, s':>17}")
    for m in results.values():
        print(f"{m.client:8} {m.cpu_s:16.2f} {m.alone_s:13.2f} {m.together_s:17.2f}")
    ref, lean = results["litellm"], results["openai"]
    print(
        f"litellm / openai: CPU a process {ref.cpu_s / lean.cpu_s:.2f}x, one alone {ref.alone_s / lean.alone_s:.2f}x, "
        f"{args.processes} together {ref.together_s / lean.together_s:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
