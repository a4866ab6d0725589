"""sync vs collocated-async on the same task, the same number of trained samples, with long-tailed
tool time in the harness (most rollouts wait 0.1 s on their tool, a few 1-4 s); then the policy
switch of collocated-async, drain vs keep vs partial (#29: no step waits for a running group, whose
stale tokens leave the loss, and generation goes on while the trainer trains), and sync, with
long-tailed generation lengths (each rollout first
makes a "thinking" call of 4 tokens mostly, 40 or 90 for a few; EOS ignored) on an engine whose
every batched step also waits DEVICE_STEP_MS, as a host waits on an accelerator's kernels (the
tiny model's CPU step alone is too cheap for the longest generation to cost what it costs on a GPU;
`--device-step-ms 0` measures the CPU-bound case).

    python bench/async_vs_sync.py [--quick] [--engine vllm] [--loops drain keep partial]

Every run goes through the whole pipeline (runner workers, agl-sidecar, embedded engine, receiver,
store, assembly, torch backend) from the same warm-started demo model. Prints wall-clock of the
training loop in each mode, their ratios (targets: async >= 1.8x faster than sync; keep >= 1.3x
drain's throughput; partial >= 1.5x drain's at 60 ms, >= 3x sync's), the engine's idle fraction
(no call in flight, or paused for training), and
the mean reward per trained sample in each mode.

`--engine vllm` runs the drain, keep and partial runs only, on vLLM's CPU build (.venv-vllm, built by
scripts/setup_vllm_venv.sh) with the same simulated device time per step
(`engine.options.device_step_ms`, a sleep in vLLM's worker): keep is then vLLM's
`/pause?mode=keep` with the frozen requests' prefix recomputed on resume (switch_kv: recompute).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from _demo_run import bench_args, demo_work, run_demo

ROOT = Path(__file__).resolve().parents[1]
STALENESS = 2  # async may train calls up to 2 versions old (importance-corrected); sync never lags
# A memory-bound decode step that, like a GPU's, costs about the same at any batch size: it
# dominates the tiny model's CPU step (which grows with the batch) on 2 cores.
DEVICE_STEP_MS = 60.0
sys.path.insert(0, str(ROOT))


def tool_seconds(rollout_base_url: str) -> float:
    """Long-tailed and deterministic per rollout: 80% 0.1 s, 15% 1 s, 5% 4 s."""
    u = int(hashlib.sha256(rollout_base_url.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return 0.1 if u < 0.80 else 1.0 if u < 0.95 else 4.0


def harness(task: dict[str, Any], base_url: str) -> float:
    """The demo harness after a tool/environment wait of long-tailed length."""
    from examples.demo.harness import run_episode

    time.sleep(tool_seconds(base_url))
    return run_episode(task, base_url)


def thinking_tokens(rollout_base_url: str) -> int:
    """Long-tailed and deterministic per rollout: 80% 4 tokens, 15% 40, 5% 90."""
    u = int(hashlib.sha256(b"think" + rollout_base_url.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return 4 if u < 0.80 else 40 if u < 0.95 else 90


def thinking_harness(task: dict[str, Any], base_url: str) -> float:
    """A "thinking" call of long-tailed length (its text unused), then the demo episode."""
    from examples.demo import task as demo
    from examples.demo.harness import _settings, _sync_client, run_episode

    _sync_client(base_url).chat.completions.create(
        model=_settings(task, None, None)[0], messages=demo.first_messages(task), max_tokens=thinking_tokens(base_url),
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    time.sleep(0.1)
    return run_episode(task, base_url)


def run_mode(
    mode: str,
    model: Path,
    tasks: Path,
    work: Path,
    steps: int,
    switch: str = "drain",
    name: str = "harness",
    device_step_ms: float = 0.0,
    engine: str = "embedded",
    label: str | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, float]:
    label = label or f"{mode}-{switch}-{name}"
    rows = run_demo(
        [
            *engine_overrides(engine, work / f"{label}-vllm-logs"),
            f"--engine.options.device_step_ms={device_step_ms}",
            f"--tasks={tasks}",
            f"--output_dir={work / label}",
            f"--model.path={model}",
            f"--harness.function=async_vs_sync:{name}",
            f"--loop.mode={mode}",
            f"--loop.switch={switch}",
            "--val_tasks=null",  # training throughput only: no validation rounds
            "--loop.val_every=0",
            "--loop.batch_rollouts=64",
            "--loop.concurrency=128",
            f"--loop.staleness={STALENESS}",
            f"--loop.max_steps={steps}",
            "--loop.max_train_s=0",
            f"--loop.checkpoint_every={steps + 10}",
            *extra,
        ]
    )
    wall = sum(row["time/step_s"] for row in rows)
    idle = sum(row["engine/idle_fraction"] * row["time/step_s"] for row in rows) / wall
    samples = sum(row["rollouts/trained"] for row in rows)
    reward = sum(row["reward/mean"] * row["rollouts/trained"] for row in rows) / samples
    draining = sum(row["time/draining_s"] for row in rows)
    trained = sum(row.get("tokens/trained", 0.0) for row in rows)
    masked = sum(row.get("staleness/masked_tokens", 0.0) for row in rows)
    return {
        "wall": wall, "idle": idle, "samples": samples, "reward": reward, "draining": draining,
        "masked": masked / (masked + trained) if masked + trained else 0.0,
    }  # fmt: skip


def engine_overrides(engine: str, log_dir: Path) -> list[str]:
    if engine == "embedded":
        return []
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `bash scripts/setup_vllm_venv.sh` first")
    import yaml

    served = yaml.safe_load((ROOT / "examples/demo/config.yaml").read_text())["model"]["name"]
    return [
        "--engine.name=vllm",
        f"--engine.options.python={python}",
        f"--engine.options.served_model_name={served}",  # the name the demo harness asks for
        f"--engine.options.log_dir={log_dir}",
    ]


# name -> (loop.mode, loop.switch, more overrides). partial: no step waits for a running group (its stale
# tokens leave the loss), and rollouts go on generating while the trainer trains (#29's scheduling).
# Every loop names both of partial's knobs, so a config that trains partial (examples/hops) is no loop's base.
_WAITS = ("--loop.stale_policy=wait", "--loop.generate_during_training=false")
LOOPS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sync": ("sync", "drain", _WAITS),
    "drain": ("collocated-async", "drain", _WAITS),
    "keep": ("collocated-async", "keep", _WAITS),
    "partial": (
        "collocated-async", "keep", ("--loop.stale_policy=mask", "--loop.generate_during_training=true"),
    ),  # fmt: skip
}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device-step-ms", type=float, default=DEVICE_STEP_MS,
        help=f"device time per engine step in the switch runs (default {DEVICE_STEP_MS:g}; 0: CPU-bound)",
    )  # fmt: skip
    parser.add_argument(
        "--engine", choices=("embedded", "vllm"), default="embedded",
        help="vllm: only the drain, keep and partial runs, on vLLM's CPU build (.venv-vllm)",
    )  # fmt: skip
    parser.add_argument(
        "--loops", nargs="+", choices=tuple(LOOPS), default=None,
        help="only these loops, on the long-tailed generation workload (skips the tool-time comparison)",
    )  # fmt: skip


def main() -> int:
    args = bench_args(__doc__, 4, 12, "fewer steps (about a minute)", options)
    steps, device_step_ms = args.steps, args.device_step_ms
    from examples.demo.task import write_tasks

    work = demo_work("agl-bench-async-")
    tasks = write_tasks(work.folder / "tasks.jsonl", 256, 0)
    if args.engine == "vllm" or args.loops:
        names = tuple(args.loops or ("drain", "keep", "partial"))
        return compare_switches(work, tasks, steps, device_step_ms, names, args.engine)
    results = {mode: run_mode(mode, work.model, tasks, work.folder, steps) for mode in ("sync", "collocated-async")}
    sync, fast = results["sync"], results["collocated-async"]
    for mode, r in results.items():
        print(
            f"{mode:17} {r['wall']:7.1f} s for {r['samples']:.0f} trained rollouts; engine idle {r['idle']:5.1%};"
            f" reward/sample {r['reward']:.3f}"
        )
    # The wait policy may add a group to a step, so compare throughput (trained rollouts per second).
    speedup = (fast["samples"] / fast["wall"]) / (sync["samples"] / sync["wall"])
    print(f"speed-up collocated-async vs sync (trained rollouts/s): {speedup:.2f}x  (target >= 1.8x)")

    names = ("sync", "drain", "keep", "partial")
    return compare_switches(work, tasks, steps, device_step_ms, names, "embedded")


def compare_switches(work: Any, tasks: Path, steps: int, device_step_ms: float, names: tuple[str, ...], engine: str) -> int:
    print(f"long-tailed generation lengths, {device_step_ms:g} ms of device time per engine step ({engine} engine):")
    switches = {}
    for name in names:
        mode, switch, extra = LOOPS[name]
        switches[name] = run_mode(
            mode, work.model, tasks, work.folder, steps, switch, "thinking_harness", device_step_ms, engine,
            label=name, extra=extra,
        )  # fmt: skip
    for name, r in switches.items():
        print(
            f"{name:17} {r['wall']:7.1f} s for {r['samples']:.0f} trained rollouts; engine idle {r['idle']:5.1%};"
            f" reward/sample {r['reward']:.3f}; draining {r['draining']:5.1f} s"
            + (f"; stale tokens masked {r['masked']:.1%}" if name == "partial" else "")
        )

    def rate(name: str) -> float:
        return switches[name]["samples"] / switches[name]["wall"]

    goals = {("keep", "drain"): ">= 1.3x", ("partial", "drain"): ">= 1.5x at 60 ms, >= 1.2x at 20 ms",
             ("partial", "sync"): ">= 3x", ("partial", "keep"): ""}  # fmt: skip
    for (new, old), goal in goals.items():
        if new in switches and old in switches:
            target = f"; goal {goal})" if goal else ")"
            print(f"{new} vs {old}: {rate(new) / rate(old):.2f}x  (trained rollouts/s{target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
