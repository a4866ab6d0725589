"""The event simulation behind bench/simulate.py: an RL run's rollouts, engine replicas and trainer, in
simulated time (discrete events on one heap; deterministic given the seed; no wall clock).

    workload   what one rollout does: a list of segments, each a model call (new prompt tokens,
               generated tokens) or a gap in seconds (tool, environment, the harness's own time)
    engine     per replica: continuous batching; a decode step costs base + per sequence + per
               context token (memory-bound: about the same at any batch size on a GPU), and every
               sequence in the batch gains one token a step; prompts prefill at a token rate,
               stalling the replica's decode meanwhile; a call joins at the next step boundary
    trainer    a step costs fixed + per rollout + GPU-seconds per token over the trainer's GPUs; then
               the weight sync (and, collocated, the engine's sleep/wake and the trainer's offload)
    loop       sync, drain, keep (agl's loop today, trainer/agl_trainer/loop/) and partial (issue 29)

Between two events a replica's batch does not change, so its decode is a fluid: a virtual clock
counts steps, a call finishes when the clock reaches its admission step plus its tokens, and only the
earliest finish is on the heap. That keeps a 512-GPU run at a few events per call.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Protocol

Mode = Literal["sync", "drain", "keep", "partial"]
MODES: tuple[Mode, ...] = ("sync", "drain", "keep", "partial")
Placement = Literal["collocated", "split"]
EPS = 1e-9


# --- workloads ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    prompt: int  # new prompt tokens to prefill (the earlier context is cached)
    tokens: int  # generated tokens


Segment = float | Call  # a float: seconds without a call in flight (tool, environment, harness)


@dataclass(frozen=True)
class Dist:
    """A sampled quantity. kind: const (values[0]); choice (values with weights); lognormal (median,
    sigma); each clipped to [low, high]."""

    kind: Literal["const", "choice", "lognormal"]
    values: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()
    median: float = 0.0
    sigma: float = 0.0
    low: float = 0.0
    high: float = math.inf

    def sample(self, rng: random.Random) -> float:
        if self.kind == "lognormal":
            x = self.median * math.exp(self.sigma * rng.gauss())
        elif self.kind == "const":
            x = self.values[0]
        else:
            x = rng.choices(self.values, self.weights)[0]
        return self.low if x < self.low else min(x, self.high)


def const(x: float) -> Dist:
    return Dist("const", (x,))


def choice(pairs: dict[float, float]) -> Dist:
    return Dist("choice", tuple(pairs), tuple(pairs.values()))


def lognormal(median: float, sigma: float, low: float = 0.0, high: float = math.inf) -> Dist:
    return Dist("lognormal", median=median, sigma=sigma, low=low, high=high)


class Workload(Protocol):
    name: str

    def rollout(self, task: random.Random, own: random.Random) -> list[Segment]:
        """One rollout's segments; `task` is shared by a group's members (same task), `own` is not."""
        ...


@dataclass(frozen=True)
class Scripted:
    """A fixed script whose gaps and call lengths are drawn per rollout (the benches' harnesses)."""

    name: str
    script: tuple[Dist | tuple[Dist, Dist], ...]  # a Dist: a gap; (prompt, tokens): a call

    def rollout(self, task: random.Random, own: random.Random) -> list[Segment]:
        out: list[Segment] = []
        for part in self.script:
            if isinstance(part, Dist):
                out.append(part.sample(own))
            else:
                out.append(Call(round(part[0].sample(own)), max(1, round(part[1].sample(own)))))
        return out


@dataclass(frozen=True)
class Agentic:
    """A multi-turn agent: turns, generated tokens per turn and tool time between turns, long-tailed.
    A task's difficulty (shared by its group) scales its turns; the context grows by each turn's
    observation and generation and ends the rollout at `max_context`."""

    name: str
    turns: Dist
    difficulty: Dist  # multiplies turns; shared by the group
    first_prompt: Dist
    observation: Dist  # new prompt tokens per later turn (the tool's output)
    tokens: Dist
    tool_s: Dist
    max_turns: int
    max_context: int

    def rollout(self, task: random.Random, own: random.Random) -> list[Segment]:
        scale = self.difficulty.sample(task)
        turns = max(1, min(self.max_turns, round(self.turns.sample(own) * scale)))
        out: list[Segment] = []
        context = 0
        for turn in range(turns):
            prompt = round((self.first_prompt if turn == 0 else self.observation).sample(own))
            tokens = max(1, round(self.tokens.sample(own)))
            if context + prompt + tokens > self.max_context:
                break
            if turn:
                out.append(self.tool_s.sample(own))
            out.append(Call(prompt, tokens))
            context += prompt + tokens
        return out


@dataclass(frozen=True)
class Recorded:
    """Rollouts replayed from a store of real traces (bench/simulate.py: load_traces), drawn at random."""

    name: str
    rollouts: tuple[tuple[Segment, ...], ...]

    def rollout(self, task: random.Random, own: random.Random) -> list[Segment]:
        return list(self.rollouts[own.randrange(len(self.rollouts))])


# --- the cluster -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineModel:
    step_base_s: float  # a decode step at any batch size (a GPU: reading the weights)
    step_per_seq_s: float  # per sequence in the batch (sampling; on a CPU, the model itself)
    step_per_ctx_s: float  # per token of context in the batch (reading the KV cache)
    prefill_tokens_per_s: float  # math.inf: prompts cost nothing (the first token rides on a step)
    max_batch: int
    kv_tokens: float  # KV cache per replica, in tokens (admission waits beyond it)
    call_overhead_s: float  # harness -> sidecar -> engine -> back, per call, outside the engine
    gpus_per_replica: int = 1


@dataclass(frozen=True)
class TrainerModel:
    fixed_s: float  # per step: assembly, optimizer step, pause/resume, canary
    per_rollout_s: float
    gpu_s_per_token: float  # forward + backward (+ old log-probs) per trained token, in GPU-seconds
    sync_s: float  # weight export, transfer and load into the engine
    switch_s: float = 0.0  # collocated only: engine sleep + wake, trainer offload + onload


@dataclass(frozen=True)
class Cluster:
    gpus: int
    placement: Placement
    engine: EngineModel
    trainer: TrainerModel
    engine_gpus: int = 0  # split only: the engine's pool; the rest train

    @property
    def replicas(self) -> int:
        pool = self.gpus if self.placement == "collocated" else self.engine_gpus
        return max(1, pool // self.engine.gpus_per_replica)

    @property
    def train_gpus(self) -> int:
        return self.gpus if self.placement == "collocated" else self.gpus - self.engine_gpus


@dataclass(frozen=True)
class LoopSpec:
    batch_rollouts: int
    group_size: int
    concurrency: int  # rollouts in flight (async modes; sync launches one batch)
    staleness: int  # a group launched under v trains at c only if c - v <= staleness
    steps: int
    warmup_steps: int = 0  # steps left out of the measured window
    start_s: float = 0.0  # launch -> the harness's first segment (runner dispatch, sandbox start)
    finish_s: float = 0.0  # the harness's end -> the loop sees the rollout complete (grader, grace, poll)
    # partial, a running group at the staleness bound: wait for it (the loop keeps launching meanwhile),
    # drop it (killed at the update), or mask (it runs on; tokens older than the bound get no loss)
    overdue: Literal["wait", "drop", "mask"] = "wait"
    # overdue=mask (agl's loop.stale_policy=mask): the loop launches up to max_span batches ahead, and a
    # group still running when it would run across max_span updates is dropped at that update
    max_span: int = 4


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: Workload
    cluster: Cluster
    loop: LoopSpec
    notes: str = ""


# --- simulation state --------------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class Group:
    index: int
    launched_version: int
    members: list[Rollout] = field(default_factory=list)
    seen: int = 0  # members the loop saw complete

    @property
    def done(self) -> bool:
        return self.seen == len(self.members)


@dataclass(eq=False, slots=True)
class Rollout:
    index: int
    group: Group
    segments: list[Segment]
    replica: Replica
    pos: int = 0
    context: int = 0
    tokens: int = 0  # prompt + generated: what training reads
    first_version: int | None = None  # the version of its oldest token
    call_version: int = 0  # the version its call at the engine started under
    generated: list[tuple[int, int]] = field(
        default_factory=list
    )  # (version it started under, tokens) a call
    last_version: int = 0
    call: Call | None = None  # the call at the engine (admitted or waiting)
    call_context: float = 0.0
    alive: bool = True
    harness_done: bool = False  # its last segment is over
    seen: bool = False
    trained_step: int | None = None


class Replica:
    """One engine replica, its decode as a fluid between events (see the module's docstring)."""

    __slots__ = (
        "active", "base", "busy_s", "context", "epoch", "finishes", "frozen_at", "index", "last", "m",
        "per_ctx", "per_seq", "stall_until", "v", "waiting", "wake_at",
    )  # fmt: skip

    def __init__(self, index: int, model: EngineModel) -> None:
        self.index, self.m = index, model
        self.base, self.per_seq, self.per_ctx = model.step_base_s, model.step_per_seq_s, model.step_per_ctx_s
        self.active: dict[Rollout, float] = {}  # -> the virtual step at which its call finishes
        self.finishes: list[tuple[float, int, Rollout]] = []
        self.waiting: deque[Rollout] = deque()
        self.v = 0.0  # decode steps so far (virtual)
        self.last = 0.0
        self.stall_until = 0.0  # prefill in progress: no decode before
        self.frozen_at: float | None = None
        self.epoch = 0  # a wake-up of an older epoch is void
        self.wake_at = math.inf  # the pending wake-up
        self.context = 0.0  # context tokens of the batch
        self.busy_s = 0.0

    def step_s(self) -> float:
        return self.base + self.per_seq * len(self.active) + self.per_ctx * self.context

    def advance(self, now: float) -> None:
        start = self.last
        self.last = now
        if self.frozen_at is not None or now <= start:
            return
        if not self.active:
            self.busy_s += max(0.0, min(now, self.stall_until) - start)
            return
        self.busy_s += now - start
        decode_from = max(start, self.stall_until)
        if now > decode_from:
            step = self.step_s()
            if step > 0:
                self.v += (now - decode_from) / step

    def idle(self) -> bool:
        return not self.active and not self.waiting

    def next_finish(self, now: float) -> float | None:
        while self.finishes and self.finishes[0][2] not in self.active:
            heapq.heappop(self.finishes)  # dropped
        if self.frozen_at is not None or not self.finishes:
            return None
        step = self.step_s()
        if step <= 0:
            return max(now, self.stall_until)
        return max(now, self.stall_until) + max(0.0, self.finishes[0][0] - self.v) * step

    def fits(self, rollout: Rollout) -> bool:
        m = self.m
        if not self.active:
            return True
        return len(self.active) < m.max_batch and self.context + rollout.call_context <= m.kv_tokens

    def admit(self, rollout: Rollout, now: float) -> None:
        call = rollout.call
        assert call is not None
        if call.prompt and math.isfinite(self.m.prefill_tokens_per_s):
            self.stall_until = max(now, self.stall_until) + call.prompt / self.m.prefill_tokens_per_s
        start = math.ceil(self.v - EPS) if self.active else self.v  # joins at the next step boundary
        self.active[rollout] = start + call.tokens
        heapq.heappush(self.finishes, (start + call.tokens, rollout.index, rollout))
        self.context += rollout.call_context

    def remove(self, rollout: Rollout) -> None:
        if rollout in self.active:
            del self.active[rollout]
            self.context -= rollout.call_context
        elif rollout in self.waiting:
            self.waiting.remove(rollout)

    def finished(self) -> list[Rollout]:
        done = []
        # a free step (infinite throughput) finishes every call once its prefill is over
        free = self.step_s() <= 0 and self.stall_until <= self.last and self.frozen_at is None
        limit = math.inf if free else self.v + 1e-6
        while self.finishes and (self.finishes[0][2] not in self.active or self.finishes[0][0] <= limit):
            _, _, rollout = heapq.heappop(self.finishes)
            if rollout in self.active:
                self.remove(rollout)
                done.append(rollout)
        if not self.active:
            self.context = 0.0  # no drift from float sums
            self.v = math.ceil(self.v - EPS)
        return done


class Router:
    """Routes a rollout to the replica with the fewest rollouts, for all its calls (sticky, as a prefix
    cache wants). A heap with stale entries skipped."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.load = [0] * len(replicas)
        self.heap = [(0, i) for i in range(len(replicas))]

    def assign(self) -> Replica:
        while True:
            load, i = heapq.heappop(self.heap)
            if load == self.load[i]:
                break
        self.load[i] += 1
        heapq.heappush(self.heap, (load + 1, i))
        return self.replicas[i]

    def release(self, replica: Replica) -> None:
        i = replica.index
        self.load[i] -= 1
        heapq.heappush(self.heap, (self.load[i], i))


@dataclass
class Result:
    mode: Mode
    trained: int  # rollouts trained in the measured window
    steps: int  # training steps in the measured window
    seconds: float  # the measured window
    throughput: float  # trained rollouts per second
    gpu: dict[str, float]  # fractions of GPU-seconds: generating, training, syncing, idle
    staleness_mean: float  # trained version - the version of the rollout's oldest token
    staleness_max: int
    span_max: int  # most versions a trained rollout's tokens spanned
    launched: int
    trained_total: int
    dropped: int
    in_flight: int
    wasted_tokens: int  # generated by dropped rollouts
    masked_fraction: float  # overdue=mask: of the trained rollouts' generated tokens, those without loss
    draining_s: float  # drain: waiting for in-flight calls at the switches (whole run)
    step_s: list[float] = field(default_factory=list)


# --- the simulation ----------------------------------------------------------------------------------
SEGMENT, ARRIVE, REPLICA, SEEN, TRAINED, SYNCED = range(6)


class Simulation:
    def __init__(self, scenario: Scenario, mode: Mode, seed: int = 0) -> None:
        self.sc, self.mode, self.seed = scenario, mode, seed
        c, loop = scenario.cluster, scenario.loop
        if loop.batch_rollouts % loop.group_size:
            raise ValueError(
                f"batch_rollouts {loop.batch_rollouts} is not a multiple of group_size {loop.group_size}"
            )
        if c.placement == "split" and not 0 < c.engine_gpus < c.gpus:
            raise ValueError(f"split placement needs 0 < engine_gpus < gpus, got {c.engine_gpus} of {c.gpus}")
        self.collocated = c.placement == "collocated"
        self.replicas = [Replica(i, c.engine) for i in range(c.replicas)]
        self.router = Router(self.replicas)
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.now = 0.0
        self.version = 0
        self.step = 0
        self.groups: dict[int, Group] = {}  # launched, neither trained nor dropped; oldest first
        self.launched_groups = 0
        self.launched = 0
        self.running = 0  # launched members not yet seen complete
        self.untrained = 0  # members of self.groups
        self.complete_members = 0  # members of done groups in self.groups
        self.updating = False
        self.paused = False
        self.draining = False
        self.held: list[Rollout] = []
        self.batch: list[Group] = []
        self.trained: list[Rollout] = []
        # rollout index -> the trained version minus its oldest trained token's
        self.staleness_of: dict[int, int] = {}
        self.masked = 0  # generated tokens trained on without loss (overdue=mask: older than the bound)
        self.generated = 0  # generated tokens of the trained rollouts
        self.span_of: dict[int, int] = {}  # rollout index -> versions its tokens span
        self.dropped = 0
        self.wasted = 0
        self.train_s = 0.0
        self.drain_s = 0.0
        self.drain_started = 0.0
        self.sync_s = 0.0
        self.step_ends: list[float] = []
        self.window: tuple[float, float, float, float] | None = None  # t, busy, train, sync at warm-up's end
        self.ended = False

    # --- events ------------------------------------------------------------------------------------
    def at(self, t: float, kind: int, obj: object = None, arg: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, arg))

    def run(self) -> Result:
        if self.mode == "sync":
            self.launch_batch()
        else:
            self.pump()
        while self.events and not self.ended:
            t, _, kind, obj, arg = heapq.heappop(self.events)
            self.now = t
            if kind == SEGMENT:
                self.next_segment(obj)  # type: ignore[arg-type]
            elif kind == ARRIVE:
                self.arrive(obj)  # type: ignore[arg-type]
            elif kind == REPLICA:
                self.on_replica(obj, arg)  # type: ignore[arg-type]
            elif kind == SEEN:
                self.on_seen(obj)  # type: ignore[arg-type]
            elif kind == TRAINED:
                self.on_trained()
            else:
                self.on_synced()
        if not self.ended:
            raise RuntimeError(f"{self.mode}: the run stalled at step {self.step} (t={self.now:.1f} s)")
        return self.result()

    # --- rollouts ----------------------------------------------------------------------------------
    def launch_group(self) -> None:
        loop = self.sc.loop
        group = Group(self.launched_groups, self.version)
        self.launched_groups += 1
        task = random.Random(f"{self.seed}:task:{group.index}")
        for _ in range(loop.group_size):
            own = random.Random(f"{self.seed}:rollout:{self.launched}")
            rollout = Rollout(self.launched, group, self.sc.workload.rollout(task, own), self.router.assign())
            self.launched += 1
            group.members.append(rollout)
            self.at(self.now + loop.start_s, SEGMENT, rollout)
        self.groups[group.index] = group
        self.running += loop.group_size
        self.untrained += loop.group_size

    def next_segment(self, r: Rollout) -> None:
        """The rollout's gaps up to its next call (one event: nothing happens to it in between)."""
        if not r.alive:
            return
        t = self.now
        segments = r.segments
        while r.pos < len(segments) and isinstance(segments[r.pos], (float, int)):
            t += segments[r.pos]  # type: ignore[operator]
            r.pos += 1
        if r.pos == len(segments):
            r.harness_done = (
                True  # (a rollout killed in its last gap counts as done here; nothing hangs on it)
            )
            self.router.release(r.replica)
            self.at(t + self.sc.loop.finish_s, SEEN, r)
            return
        call = segments[r.pos]
        r.pos += 1
        r.call = call
        r.call_context = r.context + call.prompt + call.tokens / 2  # its mean context while decoding
        self.at(t + self.sc.cluster.engine.call_overhead_s, ARRIVE, r)

    def arrive(self, r: Rollout) -> None:
        if not r.alive:
            return
        if self.paused:
            self.held.append(r)  # the sidecar holds new calls while paused
            return
        self.submit(r)

    def submit(self, r: Rollout) -> None:
        rep = r.replica
        rep.advance(self.now)
        if r.first_version is None:
            r.first_version = self.version
        r.call_version = self.version
        if rep.fits(r) and not rep.waiting:
            rep.admit(r, self.now)
        else:
            rep.waiting.append(r)
        self.reschedule(rep)

    def reschedule(self, rep: Replica) -> None:
        """Wake the replica at its next finish. A pending earlier wake-up stays (it finds nothing done
        and reschedules): most admissions only delay the next finish, and need no event of their own."""
        t = rep.next_finish(self.now)
        if t is None or t >= rep.wake_at:
            return
        rep.epoch += 1  # the later pending wake-up is void
        rep.wake_at = t
        self.at(t, REPLICA, rep, rep.epoch)

    def on_replica(self, rep: Replica, epoch: int) -> None:
        if epoch != rep.epoch:
            return
        rep.wake_at = math.inf
        rep.advance(self.now)
        for r in rep.finished():
            call = r.call
            assert call is not None
            r.context += call.prompt + call.tokens
            r.tokens += call.prompt + call.tokens
            r.generated.append((r.call_version, call.tokens))
            r.last_version = self.version
            r.call = None
            self.at(self.now, SEGMENT, r)
        while rep.waiting and rep.fits(rep.waiting[0]):
            rep.admit(rep.waiting.popleft(), self.now)
        self.reschedule(rep)
        if self.draining and all(x.idle() for x in self.replicas):
            self.draining = False
            self.drain_s += self.now - self.drain_started
            self.start_training()

    def on_seen(self, r: Rollout) -> None:
        if not r.alive:
            return
        r.seen = True
        self.running -= 1
        group = r.group
        group.seen += 1
        if group.done:
            self.complete_members += len(group.members)
        if self.mode == "sync":
            if self.complete_members == self.untrained:
                self.begin_update(list(self.groups.values()))
        else:
            self.pump()

    def drop(self, group: Group) -> None:
        """partial, overdue=drop (or mask, past max_span): the group's harnesses are killed; its tokens
        so far are wasted."""
        for r in group.members:
            if r.alive and not r.seen:
                self.running -= 1
            r.alive = False
            if r.call is not None:
                r.replica.advance(self.now)
                r.replica.remove(r)
                self.reschedule(r.replica)
            if not r.harness_done:
                self.router.release(r.replica)
            self.wasted += r.tokens
        self.held = [r for r in self.held if r.alive]
        del self.groups[group.index]
        self.untrained -= len(group.members)
        self.dropped += len(group.members)

    # --- the loop ----------------------------------------------------------------------------------
    def launch_batch(self) -> None:
        loop = self.sc.loop
        for _ in range(loop.batch_rollouts // loop.group_size):
            self.launch_group()

    def overdue(self) -> list[Group]:
        """Groups that must train in this step: trained later they would lag the bound (oldest first,
        so they are a prefix of self.groups)."""
        out = []
        for g in self.groups.values():
            if g.launched_version > self.version - self.sc.loop.staleness:
                break
            out.append(g)
        return out

    def pump(self) -> None:
        """Async modes, as agl's loop polls: update when complete groups fill a batch (and no group it
        must wait for runs), else launch what fits. Partial on split GPUs launches while it trains."""
        if self.ended:
            return
        if self.updating:
            if self.mode == "partial" and not self.collocated and not self.paused:
                self.launch_what_fits(waiting=False)
            return
        loop = self.sc.loop
        overdue = self.overdue()
        dropping = self.mode == "partial" and loop.overdue == "drop"
        waiting = self.mode != "partial" or loop.overdue == "wait"
        waiting = waiting and any(not g.done for g in overdue)
        if self.complete_members >= loop.batch_rollouts and not waiting:
            if dropping:  # at the update, as agl's stale_policy=drop: never while generating
                for g in [g for g in overdue if not g.done]:
                    self.drop(g)
            if self.mode == "partial" and loop.overdue == "mask":  # over loop.max_span after this update
                for g in [g for g in self.groups.values() if not g.done]:
                    if self.version + 1 - g.launched_version >= loop.max_span:
                        self.drop(g)
            batch, count = [], 0
            for g in self.groups.values():
                if g.done and (count < loop.batch_rollouts or g in overdue):
                    batch.append(g)
                    count += len(g.members)
            self.begin_update(batch)
            if self.mode == "partial" and not self.collocated:
                self.launch_what_fits(waiting=False)
            return
        self.launch_what_fits(waiting)

    def launch_what_fits(self, waiting: bool) -> None:
        """Under loop.concurrency and (staleness + 1) batches launched and untrained (overdue=mask:
        max_span batches, as agl's loop). Drain and keep launch nothing while a group they must wait for
        runs (agl's loop: it would only compete); partial keeps the engine full."""
        loop = self.sc.loop
        masking = self.mode == "partial" and loop.overdue == "mask"
        cap = (loop.max_span if masking else loop.staleness + 1) * loop.batch_rollouts
        size = loop.group_size
        if waiting and self.mode != "partial":
            return
        while self.running + size <= max(loop.concurrency, size) and self.untrained + size <= cap:
            self.launch_group()

    def begin_update(self, batch: list[Group]) -> None:
        self.updating = True
        self.batch = batch
        for g in batch:
            del self.groups[g.index]
            self.untrained -= len(g.members)
            self.complete_members -= len(g.members)
        if self.mode == "drain":
            self.paused = True
            if all(r.idle() for r in self.replicas):
                self.start_training()
            else:
                self.draining = True
                self.drain_started = self.now
        elif self.mode == "keep" or (self.mode == "partial" and self.collocated):
            self.paused = True
            self.freeze()
            self.start_training()
        else:  # sync (nothing in flight) or partial on split GPUs: generation goes on while training
            self.start_training()

    def freeze(self) -> None:
        for rep in self.replicas:
            rep.advance(self.now)
            rep.frozen_at = self.now
            rep.epoch += 1
            rep.wake_at = math.inf

    def thaw(self) -> None:
        for rep in self.replicas:
            if rep.frozen_at is None:
                continue
            if rep.stall_until > rep.frozen_at:
                rep.stall_until += self.now - rep.frozen_at
            rep.frozen_at = None
            rep.last = self.now
            self.reschedule(rep)

    def start_training(self) -> None:
        t = self.sc.cluster.trainer
        rollouts = [r for g in self.batch for r in g.members]
        tokens = sum(r.tokens for r in rollouts)
        seconds = (
            t.fixed_s
            + t.per_rollout_s * len(rollouts)
            + t.gpu_s_per_token * tokens / self.sc.cluster.train_gpus
        )
        self.train_s += seconds
        oldest_allowed = self.version - self.sc.loop.staleness
        masking = self.mode == "partial" and self.sc.loop.overdue == "mask"
        for r in rollouts:  # trained with the current weights
            r.trained_step = self.step
            self.trained.append(r)
            # a call's tokens count as of the version it started under (a frozen call's later tokens
            # are newer: this errs old)
            kept = (
                [v for v, n in r.generated if v >= oldest_allowed] if masking else [v for v, _ in r.generated]
            )
            self.masked += sum(n for v, n in r.generated if masking and v < oldest_allowed)
            self.generated += sum(n for _, n in r.generated)
            first = min(kept, default=self.version)
            self.staleness_of[r.index] = self.version - first
            self.span_of[r.index] = r.last_version - min((v for v, _ in r.generated), default=r.last_version)
        self.at(self.now + seconds, TRAINED)

    def on_trained(self) -> None:
        t = self.sc.cluster.trainer
        if self.mode == "partial" and not self.collocated:
            self.paused = True  # only the weight load stops generation
            self.freeze()
        seconds = t.sync_s + (t.switch_s if self.collocated else 0.0)
        self.sync_s += seconds
        self.at(self.now + seconds, SYNCED)

    def on_synced(self) -> None:
        self.version += 1
        self.step += 1
        self.step_ends.append(self.now)
        self.updating = False
        self.paused = False
        self.thaw()
        held, self.held = self.held, []
        for r in held:
            self.submit(r)
        loop = self.sc.loop
        if self.step == loop.warmup_steps:
            self.mark_window()
        if self.step >= loop.steps:
            self.ended = True
            return
        if self.mode == "sync":
            self.launch_batch()
        else:
            self.pump()

    # --- results -----------------------------------------------------------------------------------
    def busy(self) -> float:
        for rep in self.replicas:
            rep.advance(self.now)
        return sum(rep.busy_s for rep in self.replicas) * self.sc.cluster.engine.gpus_per_replica

    def mark_window(self) -> None:
        self.window = (self.now, self.busy(), self.train_s, self.sync_s)

    def result(self) -> Result:
        c, loop = self.sc.cluster, self.sc.loop
        t0, busy0, train0, sync0 = self.window or (0.0, 0.0, 0.0, 0.0)
        seconds = self.now - t0
        in_window = [
            r for r in self.trained if r.trained_step is not None and r.trained_step >= loop.warmup_steps
        ]
        total = c.gpus * seconds
        generating = self.busy() - busy0
        training = (self.train_s - train0) * c.train_gpus
        syncing = (self.sync_s - sync0) * c.gpus
        gpu = {
            "generating": generating / total,
            "training": training / total,
            "syncing": syncing / total,
            "idle": max(0.0, 1.0 - (generating + training + syncing) / total),
        }
        stale = [self.staleness_of[r.index] for r in in_window]
        spans = [self.span_of[r.index] for r in in_window]
        in_flight = sum(1 for g in self.groups.values() for r in g.members if r.alive) + sum(
            1 for g in self.batch for r in g.members if r.trained_step is None
        )
        ends = [self.step_ends[0], *[b - a for a, b in zip(self.step_ends, self.step_ends[1:])]]
        return Result(
            mode=self.mode,
            trained=len(in_window),
            steps=self.step - loop.warmup_steps,
            seconds=seconds,
            throughput=len(in_window) / seconds if seconds > 0 else 0.0,
            gpu=gpu,
            staleness_mean=sum(stale) / len(stale) if stale else 0.0,
            staleness_max=max(stale, default=0),
            span_max=max(spans, default=0),
            launched=self.launched,
            trained_total=len(self.trained),
            dropped=self.dropped,
            in_flight=in_flight,
            wasted_tokens=self.wasted,
            masked_fraction=self.masked / self.generated if self.generated else 0.0,
            draining_s=self.drain_s,
            step_s=ends,
        )


def simulate(scenario: Scenario, mode: Mode, seed: int = 0) -> Result:
    return Simulation(scenario, mode, seed).run()
