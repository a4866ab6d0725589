"""Simulate an RL run on a cluster agl cannot run here: trained rollouts per second, GPU time split and
staleness for each scheduling mode, from an event simulation (bench/_simulation.py; pure Python,
deterministic given --seed, a 512-GPU run in seconds).

Modes (the training loop's, trainer/agl_trainer/loop/, plus the one issue 29 asks for):
  sync     launch a batch, wait for all of it, train, sync the weights
  drain    collocated-async, loop.switch=drain: at a weight switch, wait for the calls in flight
  keep     collocated-async, loop.switch=keep: calls in flight freeze and continue under the new weights
  partial  a step starts as soon as complete groups fill a batch; running groups keep generating (split
           GPUs: during training too; collocated: frozen for training and the weight load) and train at
           a later step; the loop keeps launching while it waits for a group at the staleness bound
           (--overdue drop: that group is killed at the update; mask: it never waits, the tokens older
           than the bound get no loss; staleness is then per token)
In every async mode a group launched under version v trains at version c only if c - v <= staleness,
and at most (staleness + 1) batches of rollouts are launched and untrained (agl's launch cap).

Scenarios:
  this-machine        bench/async_vs_sync.py's switch runs: the embedded engine at 60 ms of device time
                      a step, the thinking harness (80% 4 tokens, 15% 40, 5% 90), 64 rollouts a step
  this-machine-20ms   the same at 20 ms a step
  this-machine-tools  its sync vs async run: tool time 80% 0.1 s, 15% 1 s, 5% 4 s; no device time
  swe                 examples/swe/: Qwen3-8B-class on H200s, mini-swe-agent (long-tailed turns, tokens
                      and tool time); --gpus 8|64|512, --placement collocated|split

    python bench/simulate.py --calibrate                  # this-machine: predicted vs measured
    python bench/simulate.py --scenario swe --gpus 64     # one scenario, every mode
    python bench/simulate.py --scenario swe --gpus 512 --placement split --json swe512.json
    python bench/simulate.py --scenario swe --traces runs/demo/rollouts.db   # rollouts from a store

--traces replaces the scenario's workload with rollouts replayed from a rollout store (`agl traces`
data): each rollout's calls (new prompt tokens, generated tokens) and the gaps between them, drawn at
random. Generation time always comes from the scenario's engine model, not the recorded durations.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_simulation.py, run as a script or imported

from _simulation import (
    MODES,
    Agentic,
    Call,
    Cluster,
    EngineModel,
    LoopSpec,
    Mode,
    Recorded,
    Result,
    Scenario,
    Scripted,
    Segment,
    Simulation,
    TrainerModel,
    choice,
    const,
    lognormal,
    simulate,
)

# --- this machine: bench/async_vs_sync.py ------------------------------------------------------------
# An engine step's host time (the model's CPU step, the server handing each sequence its token, the
# GIL and thread hand-offs) measured once here through the embedded engine's HTTP API (a client process,
# N concurrent 40-token calls, 60 ms of device time; 2 cores at load average 8-10): 10 ms + 0.2 ms a
# sequence (70 ms a step at batch 1, 83 ms at 64, 100 ms at 128). The bare batching step is 1-3.4 ms.
HOST_STEP_BASE_S = 0.010
HOST_STEP_PER_SEQ_S = 0.0002
# The one fitted workload parameter: the host time's scale on the quiet machine of docs/results.md's runs,
# fitted by --calibrate --fit to sync's wall at 60 ms (89.0 s); every other number is then predicted.
HOST_SCALE = 0.71
# The path of a call outside the engine's steps (response back, the harness, the next request through
# the sidecar): runs/demo/rollouts.db, the demo's recorded store, median 81 ms from a rollout's first
# call's end to its second's start (the tool between them is instant).
DEMO_CALL_OVERHEAD_S = 0.081
# The demo run's metrics (runs/demo/metrics.jsonl, 128 rollouts a step): assembly + train 0.11 s, canary
# 0.02 s, weight sync 1.5 ms.
DEMO_TRAIN_FIXED_S = 0.08
DEMO_TRAIN_PER_ROLLOUT_S = 0.0004
DEMO_SYNC_S = 0.002
# loop.completion_grace_s (0.5 s in examples/demo/config.yaml) after the harness exits, plus half a
# 50 ms poll of the loop
DEMO_FINISH_S = 0.525

THINKING = Scripted(
    "thinking harness",
    (
        (const(12), choice({4: 0.80, 40: 0.15, 90: 0.05})),  # the thinking call (ignore_eos)
        const(0.1),  # its sleep
        (const(12), const(3)),  # the demo episode: call 1 (examples/demo/task.py CALL1_MAX_TOKENS)
        const(0.0),  # the tool: instant
        (const(20), const(2)),  # call 2
    ),
)
TOOLS = Scripted(
    "tool-time harness",
    (
        choice({0.1: 0.80, 1.0: 0.15, 4.0: 0.05}),  # async_vs_sync.tool_seconds
        (const(12), const(3)),
        const(0.0),
        (const(20), const(2)),
    ),
)


def this_machine(
    device_step_ms: float = 60.0, workload: Scripted = THINKING, host_scale: float = HOST_SCALE
) -> Scenario:
    """bench/async_vs_sync.py on this machine: one embedded engine; trainer and engine share the CPU."""
    engine = EngineModel(
        step_base_s=device_step_ms / 1000 + host_scale * HOST_STEP_BASE_S,
        step_per_seq_s=host_scale * HOST_STEP_PER_SEQ_S,
        step_per_ctx_s=0.0,
        prefill_tokens_per_s=math.inf,  # the first token comes from the prefill step
        max_batch=256,
        kv_tokens=math.inf,
        call_overhead_s=DEMO_CALL_OVERHEAD_S,
    )
    trainer = TrainerModel(DEMO_TRAIN_FIXED_S, DEMO_TRAIN_PER_ROLLOUT_S, 0.0, DEMO_SYNC_S)
    loop = LoopSpec(
        batch_rollouts=64,
        group_size=8,
        concurrency=128,
        staleness=2,
        steps=12,
        start_s=0.0,
        finish_s=DEMO_FINISH_S,
    )
    name = "this-machine" + ("" if workload is THINKING else "-tools") + f" ({device_step_ms:g} ms a step)"
    return Scenario(name, workload, Cluster(1, "collocated", engine, trainer), loop)


# --- the SWE setting: examples/swe/config.yaml -------------------------------------------------------
# Qwen3-8B: 8.2e9 parameters, 36 layers, 8 KV heads of 128: 147 KiB of bf16 KV cache per token.
QWEN3_8B_PARAMS = 8.2e9
KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2
H200_HBM_BYTES_PER_S = 4.8e12 * 0.75  # what decode attains of the 4.8 TB/s peak
H200_BF16_FLOPS = 989e12
TRAIN_MFU = 0.30  # FSDP2 with gradient checkpointing, long sequences (assumed; agl has not measured it)
# per trained token: forward + backward (6N), the checkpointed forward again (2N), old log-probs (2N)
TRAIN_FLOPS_PER_TOKEN = 10 * QWEN3_8B_PARAMS

SWE_WORKLOAD = Agentic(
    "mini-swe-agent (parametric)",
    turns=lognormal(12, 0.6, low=2),
    difficulty=lognormal(1.0, 0.4),  # a hard task makes all 8 attempts long
    first_prompt=lognormal(3000, 0.3),  # system prompt + problem statement
    observation=lognormal(400, 1.0, high=8000),  # a command's output
    tokens=lognormal(350, 0.8, low=20, high=2048),  # --max-tokens 2048
    tool_s=lognormal(2.0, 1.2, high=300),  # shell commands, test runs
    max_turns=30,  # --step-limit 30
    max_context=32768,  # engine.options.max_model_len
)


def swe(gpus: int = 8, placement: str = "collocated", engine_share: float = 0.75) -> Scenario:
    """examples/swe/ at `gpus` H200s: one vLLM replica a GPU (TP 1), verl FSDP2 trains; the batch grows
    with the cluster (8 rollouts a GPU: 64 = 8 tasks x 8 at 8 GPUs, 4096 at 512), twice that in flight."""
    collocated = placement == "collocated"
    memory = (0.6 if collocated else 0.9) * 141e9  # gpu_memory_utilization: 0.6 collocated
    kv_tokens = (memory - 2 * QWEN3_8B_PARAMS - 4e9) / KV_BYTES_PER_TOKEN
    engine = EngineModel(
        step_base_s=2 * QWEN3_8B_PARAMS / H200_HBM_BYTES_PER_S + 0.002,  # weights once a step + launch
        step_per_seq_s=0.00005,
        step_per_ctx_s=KV_BYTES_PER_TOKEN / H200_HBM_BYTES_PER_S,
        prefill_tokens_per_s=12_000.0,
        max_batch=256,
        kv_tokens=kv_tokens,
        call_overhead_s=0.05,
    )
    nodes = max(1, gpus // 8)
    train_gpus = gpus if collocated else gpus - round(gpus * engine_share)
    efficiency = 1 / (1 + 0.05 * math.log2(max(1, train_gpus / 8)))  # data-parallel scaling beyond a node
    trainer = TrainerModel(
        fixed_s=4.0,  # verl dispatch, optimizer step, assembly
        per_rollout_s=0.002,
        gpu_s_per_token=TRAIN_FLOPS_PER_TOKEN / (H200_BF16_FLOPS * TRAIN_MFU * efficiency),
        # export from FSDP (~2 s) + NCCL broadcast of 16.4 GB bf16 (~50 GB/s) + a hop per doubling of nodes
        sync_s=2.0 + 2 * QWEN3_8B_PARAMS / 50e9 + 0.1 * math.log2(nodes),
        switch_s=8.0 if collocated else 0.0,  # vLLM sleep + wake, verl param + optimizer offload/onload
    )
    batch = 8 * gpus
    loop = LoopSpec(
        batch_rollouts=batch,
        group_size=8,
        concurrency=2 * batch,
        staleness=1,  # examples/swe/config.yaml
        steps=6 if gpus >= 512 else 12,  # 4096 rollouts a step: few steps suffice (and it stays seconds)
        warmup_steps=2,
        start_s=5.0,  # copy the repo, start mini-swe-agent
        finish_s=12.0,  # grader.py runs the tests (~10 s) + loop.completion_grace_s 2.0
    )
    cluster = Cluster(
        gpus, "collocated" if collocated else "split", engine, trainer, 0 if collocated else gpus - train_gpus
    )
    return Scenario(f"swe ({gpus} GPUs, {placement})", SWE_WORKLOAD, cluster, loop)


# --- traces: a rollout store (agl traces) ------------------------------------------------------------
def load_traces(store: Path, limit: int = 5000) -> Recorded:
    """The most recent `limit` complete train-mode rollouts of a store: per rollout its calls (new prompt
    tokens, generated tokens) in start order and the gaps between them (calls that overlapped, e.g. a
    tree's sub-agents, are played one after another)."""
    from agl_trainer.store.queries import connect_ro

    db = connect_ro(store)
    try:
        keys = db.execute(
            "SELECT rollout_id, attempt, started_ns, ended_ns FROM rollouts WHERE complete = 1"
            " AND COALESCE(mode, 'train') = 'train' ORDER BY rowid DESC LIMIT ?",
            (limit,),
        ).fetchall()
        rollouts = []
        for rollout_id, attempt, started_ns, ended_ns in keys:
            calls = db.execute(
                "SELECT start_ns, end_ns, COALESCE(prompt_length,"
                " COALESCE(prompt_ref_length, 0) + COALESCE(length(prompt_ids) / 4, 0)),"
                " COALESCE(length(completion_ids) / 4, 0) FROM calls WHERE rollout_id = ? AND attempt = ?"
                " ORDER BY start_ns",
                (rollout_id, attempt),
            ).fetchall()
            if calls:
                rollouts.append(tuple(_segments(calls, started_ns, ended_ns)))
    finally:
        db.close()
    if not rollouts:
        raise SystemExit(f"{store}: no complete train rollouts with calls")
    return Recorded(f"traces of {store.name} ({len(rollouts)} rollouts)", tuple(rollouts))


def _segments(
    calls: list[tuple[int, int, int, int]], started_ns: int | None, ended_ns: int | None
) -> list[Segment]:
    out: list[Segment] = []
    previous_end = started_ns if started_ns is not None else calls[0][0]
    context = 0
    for start_ns, end_ns, prompt, tokens in calls:
        out.append(max(0.0, (start_ns - previous_end) / 1e9))
        out.append(Call(max(0, prompt - context), max(1, tokens)))
        context = max(context, prompt) + tokens
        previous_end = max(previous_end, end_ns)
    if ended_ns is not None:
        out.append(max(0.0, (ended_ns - previous_end) / 1e9))
    return out


# --- running and printing ----------------------------------------------------------------------------
def run_modes(
    scenario: Scenario, modes: tuple[Mode, ...] = MODES, seeds: int = 1, seed: int = 0
) -> dict[str, dict]:
    """Each mode over `seeds` seeds (seed, seed + 1, ...): the mean of the numbers, the max of the maxima."""
    out: dict[str, dict] = {}
    for mode in modes:
        results = [simulate(scenario, mode, seed + k) for k in range(seeds)]
        out[mode] = summary(results)
    for mode, row in out.items():
        for base in ("sync", "drain"):
            if base in out and base != mode:
                row[f"vs_{base}"] = row["throughput"] / out[base]["throughput"]
    return out


def summary(results: list[Result]) -> dict:
    mean = statistics.fmean
    return {
        "throughput": mean(r.throughput for r in results),
        "trained": mean(r.trained for r in results),
        "per_step": mean(r.trained / r.steps for r in results),
        "seconds": mean(r.seconds for r in results),
        "gpu": {k: mean(r.gpu[k] for r in results) for k in results[0].gpu},
        "staleness_mean": mean(r.staleness_mean for r in results),
        "staleness_max": max(r.staleness_max for r in results),
        "span_max": max(r.span_max for r in results),
        "draining_s": mean(r.draining_s for r in results),
        "dropped": mean(r.dropped for r in results),
        "masked_fraction": mean(r.masked_fraction for r in results),
        "seeds": len(results),
    }


def print_table(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(
        f"  {'mode':8} {'rollouts/s':>10} {'trained':>8} {'a step':>6} {'sim s':>8}"
        f"  {'gen':>5} {'train':>5} {'sync':>5} {'idle':>5}"
        f"  {'stale mean/max':>14} {'vs sync':>7} {'vs drain':>8}"
    )
    for mode, r in rows.items():
        g = r["gpu"]
        print(
            f"  {mode:8} {r['throughput']:10.3f} {r['trained']:8.0f} {r['per_step']:6.0f} {r['seconds']:8.1f}"
            f"  {g['generating']:5.0%} {g['training']:5.0%} {g['syncing']:5.0%} {g['idle']:5.0%}"
            f"  {r['staleness_mean']:7.2f} / {r['staleness_max']:<4}"
            f" {_ratio(r.get('vs_sync')):>7} {_ratio(r.get('vs_drain')):>8}"
        )
    for mode, r in rows.items():
        for base in ("sync", "drain"):
            if f"vs_{base}" in r and (base == "sync" or mode != "sync"):
                print(f"{mode} vs {base}: {r[f'vs_{base}']:.2f}x")


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


# --- calibration against bench/async_vs_sync.py ------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    name: str  # what was compared
    values: tuple[float, ...]  # each run's ratio in docs/results.md ("Loop")
    # False: a known misfit, printed with how far off it is but not held to the 15% the tests ask
    fitted: bool = True


# docs/results.md, "Loop": the embedded engine, 12 steps of 64 rollouts (two full runs at 60 ms: a quiet
# machine, then a busier one), plus the --quick (4-step) figures the section quotes
MEASURED_WALL = {"sync": 89.0, "drain": 49.9, "keep": 41.0}  # the quiet run at 60 ms, seconds
MEASURED_DRAINING = {"60": 28.7, "20": 6.6}  # drain's seconds draining, same runs
MEASURED = (
    Measured("60 ms: keep vs drain", ((800 / 41.0) / (768 / 49.9), (792 / 45.3) / (768 / 65.3), 1.31)),
    Measured("60 ms: drain vs sync", ((768 / 49.9) / (768 / 89.0), (768 / 65.3) / (768 / 110.3))),
    Measured("60 ms: keep vs sync", ((800 / 41.0) / (768 / 89.0), (792 / 45.3) / (768 / 110.3))),
    Measured("20 ms: keep vs drain", ((768 / 23.6) / (768 / 24.2), 1.22)),
    Measured("tools, 0 ms: drain vs sync", (61.0 / 24.6, 2.66)),
    # the partial scheduling (loop.stale_policy=mask, generate_during_training), two runs at 60 ms, two at 20
    Measured("60 ms: partial (mask) vs drain", ((744 / 24.2) / (768 / 46.3), (686 / 24.6) / (768 / 46.7))),
    Measured("60 ms: partial (mask) vs sync", ((744 / 24.2) / (768 / 85.5),)),
    # 25% over: at 20 ms a step the host's CPU (2 cores: the tiny model's steps, the harnesses, training while
    # generating) limits the real run, and the simulation's host time per step does not grow with the load
    Measured(
        "20 ms: partial (mask) vs drain",
        ((687 / 17.1) / (768 / 22.6), (703 / 17.0) / (768 / 23.4), (700 / 17.7) / (768 / 24.3)),
        fitted=False,
    ),
)
CALIBRATION_SEEDS = 20


def fit_host_scale(seeds: int = CALIBRATION_SEEDS) -> float:
    """The host time's scale (the one fitted parameter): sync at 60 ms takes MEASURED_WALL['sync']."""
    low, high = 0.0, 3.0
    for _ in range(16):
        mid = (low + high) / 2
        wall = statistics.fmean(
            simulate(this_machine(60, host_scale=mid), "sync", k).seconds for k in range(seeds)
        )
        low, high = (mid, high) if wall < MEASURED_WALL["sync"] else (low, mid)
    return (low + high) / 2


def calibrate(seeds: int = CALIBRATION_SEEDS, fit: bool = False) -> dict:
    scale = fit_host_scale(seeds) if fit else HOST_SCALE
    runs = {
        "60": run_modes(this_machine(60, host_scale=scale), MODES, seeds),
        "20": run_modes(this_machine(20, host_scale=scale), MODES, seeds),
        "tools": run_modes(this_machine(0, TOOLS, host_scale=scale), MODES, seeds),
        # the loop's partial scheduling as bench/async_vs_sync.py runs it: loop.stale_policy=mask
        "60-mask": run_modes(
            masking(this_machine(60, host_scale=scale)), ("sync", "drain", "partial"), seeds
        ),
        "20-mask": run_modes(masking(this_machine(20, host_scale=scale)), ("drain", "partial"), seeds),
    }
    predicted = {
        "60 ms: keep vs drain": runs["60"]["keep"]["vs_drain"],
        "60 ms: drain vs sync": runs["60"]["drain"]["vs_sync"],
        "60 ms: keep vs sync": runs["60"]["keep"]["vs_sync"],
        "20 ms: keep vs drain": runs["20"]["keep"]["vs_drain"],
        "tools, 0 ms: drain vs sync": runs["tools"]["drain"]["vs_sync"],
        "60 ms: partial (mask) vs drain": runs["60-mask"]["partial"]["vs_drain"],
        "60 ms: partial (mask) vs sync": runs["60-mask"]["partial"]["vs_sync"],
        "20 ms: partial (mask) vs drain": runs["20-mask"]["partial"]["vs_drain"],
    }
    rows = []
    for m in MEASURED:
        p = predicted[m.name]
        low, high = min(m.values), max(m.values)
        off = 0.0 if low <= p <= high else min(abs(p - low) / low, abs(p - high) / high)
        rows.append(
            {"comparison": m.name, "predicted": p, "measured": list(m.values), "off": off, "fitted": m.fitted}
        )
    walls = {mode: runs["60"][mode]["seconds"] for mode in ("sync", "drain", "keep")}
    draining = {key: runs[key]["drain"]["draining_s"] for key in ("60", "20")}
    return {
        "host_scale": scale, "fitted": fit, "seeds": seeds, "comparisons": rows, "walls_60ms": walls,
        "draining_s": draining,
        "runs": runs,
    }  # fmt: skip


def print_calibration(cal: dict) -> None:
    print(
        f"this machine (bench/async_vs_sync.py): host time scale {cal['host_scale']:.2f}"
        f" ({'fitted' if cal.get('fitted') else 'HOST_SCALE'}), {cal['seeds']} seeds a mode:"
    )
    print(f"  {'comparison':30} {'predicted':>9}  {'measured (runs)':22} {'off':>5}")
    for row in cal["comparisons"]:
        measured = " / ".join(f"{v:.2f}x" for v in row["measured"])
        note = "" if row["fitted"] else "  (known misfit, not fitted)"
        print(f"  {row['comparison']:30} {row['predicted']:8.2f}x  {measured:22} {row['off']:5.0%}{note}")
    walls = cal["walls_60ms"]
    print(
        "  60 ms, wall of 12 steps: "
        + ", ".join(f"{mode} {walls[mode]:.1f} s (measured {MEASURED_WALL[mode]:.1f})" for mode in walls)
    )
    print(
        "  drain's time draining: "
        + ", ".join(
            f"{k} ms {v:.1f} s (measured {MEASURED_DRAINING[k]:.1f})" for k, v in cal["draining_s"].items()
        )
    )
    titles = (
        ("60", "60 ms a step"), ("20", "20 ms a step"), ("tools", "tool-time harness, 0 ms"),
        ("60-mask", "60 ms a step, partial with overdue=mask"),
        ("20-mask", "20 ms a step, partial with overdue=mask"),
    )  # fmt: skip
    for key, title in titles:
        print_table(f"this machine, {title}:", cal["runs"][key])


def masking(scenario: Scenario) -> Scenario:
    """The scenario with the loop's loop.stale_policy=mask (overdue=mask: launches up to max_span batches)."""
    return replace(scenario, loop=replace(scenario.loop, overdue="mask"))


# --- the command line ---------------------------------------------------------------------------------
SCENARIOS = ("this-machine", "this-machine-20ms", "this-machine-tools", "swe")


def scenario_from(args: argparse.Namespace) -> Scenario:
    if args.scenario == "swe":
        sc = swe(args.gpus or 8, args.placement or "collocated", args.engine_share)
    elif args.scenario == "this-machine-tools":
        sc = this_machine(0, TOOLS)
    else:
        sc = this_machine(20 if args.scenario == "this-machine-20ms" else 60)
    if args.traces is not None:
        sc = replace(sc, workload=load_traces(args.traces))
    loop = sc.loop
    changes = {
        "batch_rollouts": args.batch, "group_size": args.group_size, "concurrency": args.concurrency,
        "staleness": args.staleness, "steps": args.steps, "warmup_steps": args.warmup,
        "overdue": args.overdue,
    }  # fmt: skip
    return replace(sc, loop=replace(loop, **{k: v for k, v in changes.items() if v is not None}))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario", choices=SCENARIOS, default=None,
        help="what to simulate (default: --calibrate's this-machine runs, then swe at 8, 64 and 512 GPUs)",
    )  # fmt: skip
    parser.add_argument(
        "--calibrate", action="store_true", help="this-machine predicted vs measured, then stop"
    )
    parser.add_argument(
        "--fit", action="store_true", help="with --calibrate: refit HOST_SCALE to sync's wall first"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES)
    )
    parser.add_argument("--gpus", type=int, default=None, help="swe: GPUs in the cluster (default 8)")
    parser.add_argument(
        "--placement", choices=("collocated", "split"), default=None, help="swe: engine and trainer"
    )
    parser.add_argument(
        "--engine-share", type=float, default=0.75, help="split: the engine's share of the GPUs"
    )
    parser.add_argument("--traces", type=Path, default=None, help="a rollout store: replay its rollouts")
    parser.add_argument("--batch", type=int, default=None, help="rollouts a step (loop.batch_rollouts)")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None, help="rollouts in flight (async modes)")
    parser.add_argument(
        "--staleness", type=int, default=None, help="max versions between launch and training"
    )
    parser.add_argument(
        "--overdue", choices=("wait", "drop", "mask"), default=None,
        help="partial, a running group at the staleness bound: wait for it (default), drop it at the update,"
        " or mask (it runs on; its tokens older than the bound get no loss)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="training steps simulated")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the measured window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=None, help="average over this many seeds (default 1; 20 calibrating)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--quick", action="store_true", help="the calibration with 3 seeds a mode, then stop (make bench)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.calibrate, args.seeds = True, args.seeds or 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {','.join(MODES)}")
    started = time.perf_counter()
    out: dict = {}
    if args.calibrate or args.scenario is None:
        cal = calibrate(args.seeds or CALIBRATION_SEEDS, args.fit)
        print_calibration(cal)
        out["calibration"] = cal
    if args.scenario is not None or not args.calibrate:
        if args.scenario is None:
            names = [("swe", gpus) for gpus in (8, 64, 512)]
        else:
            names = [(args.scenario, args.gpus)]
        for name, gpus in names:
            sc = scenario_from(argparse.Namespace(**{**vars(args), "scenario": name, "gpus": gpus}))
            rows = run_modes(sc, modes, args.seeds or 1, args.seed)
            print_table(f"{sc.name}, {sc.workload.name}: {describe(sc)}", rows)
            out[sc.name] = {"scenario": describe(sc), "modes": rows}
    print(f"\n(simulated in {time.perf_counter() - started:.1f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


def describe(sc: Scenario) -> str:
    loop, c = sc.loop, sc.cluster
    pools = f"{c.replicas} replicas" + (
        "" if c.placement == "collocated" else f", {c.train_gpus} training GPUs"
    )
    return (
        f"{c.gpus} GPU(s) {c.placement} ({pools}); {loop.batch_rollouts} rollouts a step in groups of"
        f" {loop.group_size}, {loop.concurrency} in flight, staleness {loop.staleness}, {loop.steps} steps"
        + (f" ({loop.warmup_steps} warm-up)" if loop.warmup_steps else "")
    )


__all__ = [
    "Call", "Cluster", "EngineModel", "LoopSpec", "Scenario", "Scripted", "Simulation", "TrainerModel",
    "calibrate",
    "const", "load_traces", "main", "run_modes", "simulate", "swe", "this_machine",
]  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
