"""A rich terminal view of one assembled rollout: calls, the call tree they merged onto, samples
with every token marked trained or masked, merge boundaries and why merges failed, rewards, policy
versions.

Everything shown that came from outside (ids, task ids, errors, reward names, decoded tokens) goes
through `printable()` and into `Text`, never into rich markup: a rollout id holding ESC, NUL, CR
or a bidi override must not drive the terminal, and one holding `[red]` must not restyle it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree
from agl import semconv

from agl_trainer.assembly.assemble import START_REASONS, CallPlacement, RolloutAssembly
from agl_trainer.printable import plain, printable  # noqa: F401 (also imported from here)
from agl_trainer.store.records import RolloutData

STYLE_PROMPT = "dim"
STYLE_CONTEXT = "yellow"  # masked: tool results and template text between merged calls
STYLE_TRAINED = "bold green"
STYLE_BOUNDARY = "bold magenta"

def _token_text(token: int, tokenizer: Any) -> str:
    if tokenizer is None:
        return f"{token} "
    return printable(tokenizer.decode([token], skip_special_tokens=False), keep_newlines=True)


def _where(placement: CallPlacement) -> Text:
    """What became of a call: merged onto its parent, a new sample and why, or skipped."""
    if placement.problem:
        return Text(f"skipped: {placement.problem}", style="red")
    if placement.sample is None:
        return Text("dropped with its sample", style="red")
    if placement.merged:
        text = Text(f"merged onto call {placement.parent}", style="green")
        if placement.declared:
            text.append(f"; declared tree disagrees: {placement.declared}", style="red")
        return text
    text = Text(START_REASONS.get(placement.start or "", "new sample").format(parent=placement.parent), style="cyan")
    if placement.declared:
        text.append(f"; declared tree disagrees: {placement.declared}", style="red")
    return text


def forest(assembly: RolloutAssembly) -> Tree:
    """The rollout's calls as the tree assembly merged them onto. A node is a chain of calls each
    merged onto the one before (one sample); under it, the calls that extend one of its calls but
    start a new sample (a branch: retry, parallel call). Roots extend no earlier call (the first
    call, a sub-agent, a compaction) or were skipped. Built without recursion: a rollout of
    thousands of merged calls is one line."""
    failures = {failure.call_seq: failure for failure in assembly.merge_failures}
    merged_child = {p.parent: p for p in assembly.placements if p.merged}
    starts: dict[int | None, list[CallPlacement]] = {}
    for placement in assembly.placements:
        if not placement.merged:
            starts.setdefault(placement.parent, []).append(placement)

    def label(chain: list[CallPlacement]) -> Text:
        head = chain[0]
        text = Text("calls " if len(chain) > 1 else "call ", style="bold")
        seqs = [str(p.call_seq) for p in chain]
        if len(seqs) > 10:  # a long thread: its ends and its length
            seqs = [*seqs[:4], "…", *seqs[-3:], f"({len(chain)} calls)"]
        text.append(" → ".join(seqs).replace(" → (", " ("), style="bold")
        text.append(f" [{'-' if head.sample is None else f'sample {head.sample}'}] ")
        text.append_text(_where(head))
        failure = failures.get(head.call_seq)
        if failure is not None:
            text.append(
                f"; break vs call {failure.previous_call_seq}: {failure.kind} at token {failure.position}",
                style="magenta",
            )
        outside = [p.call_seq for p in chain if p.origin not in (None, semconv.ORIGIN_HARNESS)]
        if outside:
            text.append(f"; outside the harness's trace: calls {outside}", style="red")
        return text

    root = Tree(Text("call tree (a line: calls merged into one sample)", style="bold"))
    stack: list[tuple[Tree, CallPlacement]] = [(root, p) for p in reversed(starts.get(None, []))]
    while stack:
        node, head = stack.pop()
        chain = [head]
        while chain[-1].call_seq in merged_child:
            chain.append(merged_child[chain[-1].call_seq])
        child = node.add(label(chain))
        for call in reversed(chain):
            stack.extend((child, branch) for branch in reversed(starts.get(call.call_seq, [])))
    return root


def render(
    console: Console,
    data: RolloutData,
    assembly: RolloutAssembly,
    tokenizer: Any = None,
    max_tokens: int = 600,
) -> None:
    info = data.info
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("rollout", plain(f"{info.rollout_id} (attempt {info.attempt})"))
    head.add_row("task", plain(info.task_id))
    head.add_row("mode", plain(info.mode or "train"))
    head.add_row(
        "status",
        plain(
            f"{'complete' if info.complete else 'open'}; end cause {info.end_cause or '-'}"
            f"{'; rollout span: ' + info.status if info.status else ''}"
            f"{'; harness exit ' + str(info.harness_exit_code) if info.harness_exit_code is not None else ''}"
        ),
    )
    if info.error:
        head.add_row("error", plain(info.error, keep_newlines=True))
    training = (
        f"trained at step {info.trained_step}"
        if info.trained_step is not None
        else f"dropped: {info.dropped_reason}"
        if info.dropped_reason
        else "not trained yet"
    )
    head.add_row("training", plain(training))
    head.add_row("reward", "none" if assembly.reward is None else f"{assembly.reward:g}")
    if assembly.dropped:
        head.add_row("assembly", Text(f"dropped: {assembly.dropped}", style="bold red"))
    if info.late_spans:
        head.add_row("late spans", str(info.late_spans))
    console.print(Panel(head, title="agl rollout", expand=False))

    if data.rewards:
        rewards = Table(title="rewards (last one per name wins)", title_justify="left")
        for column in ("name", "value", "call", "end (ns)"):
            rewards.add_column(column)
        for reward in data.rewards:
            rewards.add_row(
                plain(reward.name),
                f"{reward.value:g}",
                "-" if reward.call_seq is None else str(reward.call_seq),
                str(reward.end_ns),
            )
        console.print(rewards)

    calls = Table(title="calls", title_justify="left")
    by_seq = {call.call_seq: call for call in data.calls}
    held = any(call.held_ms for call in data.calls)  # the column only when training held some call
    agents = any(call.agent_id for call in data.calls)  # the column only when the harness declared agents
    for column in ("seq", "policy", "prompt", "completion", "finish", *(("held ms",) if held else ()),
                   *(("agent",) if agents else ()), "origin", "parent", "sample", "placement"):  # fmt: skip
        calls.add_column(column)
    for placement in assembly.placements:
        call = by_seq.get(placement.call_seq)
        prompt = (
            "-"
            if call is None or call.prompt_ids is None
            else str(call.prompt_length or call.prompt_ids.size)
        )
        if call is not None and call.prompt_ref_seq is not None:
            prompt += f" (ref call {call.prompt_ref_seq}[:{call.prompt_ref_length}] + {call.prompt_ids.size})"
        completion = "-" if call is None or call.completion_ids is None else str(call.completion_ids.size)
        calls.add_row(
            str(placement.call_seq),
            str(placement.policy_version)
            if call is None or call.policy_versions is None  # else where each version starts in it
            else " ".join(f"v{v}@{s}" for s, v in zip(call.policy_versions[0::2], call.policy_versions[1::2])),
            prompt,
            completion,
            plain(call.finish_reason if call else "-"),
            *((("-" if call is None or call.held_ms is None else f"{call.held_ms:.1f}"),) if held else ()),
            *((plain(placement.agent_id or "-"),) if agents else ()),
            plain(placement.origin or "-"),
            "-" if placement.parent is None else str(placement.parent),
            "-" if placement.sample is None else str(placement.sample),
            _where(placement),
        )
    console.print(calls)
    console.print(forest(assembly))

    if assembly.merge_failures:
        failures = Table(title="merge failures", title_justify="left")
        for column in ("call", "after call", "kind", "classified by", "at token", "why"):
            failures.add_column(column)
        for failure in assembly.merge_failures:
            failures.add_row(
                str(failure.call_seq),
                str(failure.previous_call_seq),
                plain(failure.kind),
                plain(failure.classified_by),
                str(failure.position),
                plain(failure.detail),
            )
        console.print(failures)
    counted = {**assembly.truncations, **assembly.problems}
    if counted:
        console.print("counted: " + ", ".join(f"{key} {value}" for key, value in sorted(counted.items())))

    if assembly.result is None:
        return
    for index, sample in enumerate(assembly.result.samples):
        starts = {
            p.context_start: p for p in assembly.placements if p.sample == index and p.context_start > 0
        }
        text = Text()
        n = len(sample.token_ids)
        shown = range(n) if n <= max_tokens else [*range(max_tokens // 2), *range(n - max_tokens // 2, n)]
        previous = -1
        trained = np.flatnonzero(sample.loss_mask)
        first_trained = int(trained[0]) if trained.size else n
        trained_version = None  # a trained token of another policy version than the last: marked
        for position in shown:
            if position != previous + 1:
                text.append(f" … {position - previous - 1} tokens … ", style="italic")
            previous = position
            if position in starts:
                text.append(f"⟦call {starts[position].call_seq}⟧", style=STYLE_BOUNDARY)
            token = int(sample.token_ids[position])
            if sample.loss_mask[position]:
                version = int(sample.policy_versions[position])
                if trained_version is not None and version != trained_version:
                    text.append(f"⟦v{version}⟧", style=STYLE_BOUNDARY)
                trained_version = version
                style = STYLE_TRAINED
            else:
                style = STYLE_PROMPT if position < first_trained else STYLE_CONTEXT
            text.append(_token_text(token, tokenizer), style=style)
        versions = np.unique(sample.policy_versions[sample.policy_versions >= 0]).tolist()
        legend = Text.assemble(
            ("prompt ", STYLE_PROMPT),
            ("masked ", STYLE_CONTEXT),
            ("trained ", STYLE_TRAINED),
            ("⟦merge boundary⟧ ⟦vN: policy version N from here⟧", STYLE_BOUNDARY),
        )
        title = (
            f"sample {index}: calls {sample.call_seqs}, {n} tokens, {sample.num_trained_tokens} trained,"
            f" policy versions {versions}"
        )
        if sample.token_rewards is not None:
            placed = [(i, r) for i, r in enumerate(sample.token_rewards) if r]
            title += f", per-call rewards at {placed}"
        console.print(Panel(Group(text, legend), title=title, title_align="left", expand=False))
