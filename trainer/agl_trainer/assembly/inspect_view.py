"""A rich terminal view of one assembled rollout: calls, samples with every token marked trained
or masked, merge boundaries and why merges failed, rewards, policy versions."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agl_trainer.assembly.assemble import RolloutAssembly
from agl_trainer.store.records import RolloutData

STYLE_PROMPT = "dim"
STYLE_CONTEXT = "yellow"  # masked: tool results and template text between merged calls
STYLE_TRAINED = "bold green"
STYLE_BOUNDARY = "bold magenta"


def _token_text(token: int, tokenizer: Any) -> str:
    if tokenizer is None:
        return f"{token} "
    return tokenizer.decode([token], skip_special_tokens=False)


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
    head.add_row("rollout", f"{info.rollout_id} (attempt {info.attempt})")
    head.add_row("task", str(info.task_id))
    head.add_row("mode", str(info.mode or "train"))
    head.add_row(
        "status",
        f"{'complete' if info.complete else 'open'}; end cause {info.end_cause or '-'}"
        f"{'; rollout span: ' + info.status if info.status else ''}"
        f"{'; harness exit ' + str(info.harness_exit_code) if info.harness_exit_code is not None else ''}",
    )
    if info.error:
        head.add_row("error", info.error)
    training = (
        f"trained at step {info.trained_step}"
        if info.trained_step is not None
        else f"dropped: {info.dropped_reason}"
        if info.dropped_reason
        else "not trained yet"
    )
    head.add_row("training", training)
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
                reward.name,
                f"{reward.value:g}",
                "-" if reward.call_seq is None else str(reward.call_seq),
                str(reward.end_ns),
            )
        console.print(rewards)

    calls = Table(title="calls", title_justify="left")
    for column in ("seq", "policy", "prompt", "completion", "finish", "sample", "placement"):
        calls.add_column(column)
    by_seq = {call.call_seq: call for call in data.calls}
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
        if placement.problem:
            where = Text(f"skipped: {placement.problem}", style="red")
        elif placement.sample is None:
            where = Text("dropped with its sample", style="red")
        else:
            where = Text(
                "merged" if placement.merged else "new sample", style="green" if placement.merged else "cyan"
            )
        calls.add_row(
            str(placement.call_seq),
            str(placement.policy_version),
            prompt,
            completion,
            str(call.finish_reason if call else "-"),
            "-" if placement.sample is None else str(placement.sample),
            where,
        )
    console.print(calls)

    if assembly.merge_failures:
        failures = Table(title="merge failures", title_justify="left")
        for column in ("call", "after call", "kind", "classified by", "at token", "why"):
            failures.add_column(column)
        for failure in assembly.merge_failures:
            failures.add_row(
                str(failure.call_seq),
                str(failure.previous_call_seq),
                failure.kind,
                failure.classified_by,
                str(failure.position),
                failure.detail,
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
        first_trained = next((i for i, m in enumerate(sample.loss_mask) if m), n)
        for position in shown:
            if position != previous + 1:
                text.append(f" … {position - previous - 1} tokens … ", style="italic")
            previous = position
            if position in starts:
                text.append(f"⟦call {starts[position].call_seq}⟧", style=STYLE_BOUNDARY)
            token = sample.token_ids[position]
            if sample.loss_mask[position]:
                style = STYLE_TRAINED
            else:
                style = STYLE_PROMPT if position < first_trained else STYLE_CONTEXT
            text.append(_token_text(token, tokenizer), style=style)
        versions = sorted({v for v in sample.policy_versions if v >= 0})
        legend = Text.assemble(
            ("prompt ", STYLE_PROMPT),
            ("masked ", STYLE_CONTEXT),
            ("trained ", STYLE_TRAINED),
            ("⟦merge boundary⟧", STYLE_BOUNDARY),
        )
        title = (
            f"sample {index}: calls {sample.call_seqs}, {n} tokens, {sample.num_trained_tokens} trained,"
            f" policy versions {versions}"
        )
        if sample.token_rewards is not None:
            placed = [(i, r) for i, r in enumerate(sample.token_rewards) if r]
            title += f", per-call rewards at {placed}"
        console.print(Panel(Group(text, legend), title=title, title_align="left"))
