"""A check's report for a terminal (rich), and the compatibility table docs/protocols.md shows.

Everything that came from the harness (paths, models, answers, refusal bodies, field entries, its
log) is printed through `printable` as text, never as rich markup.
"""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agl_trainer.harness_check.report import Call, Report
from agl_trainer.printable import plain, printable

LOG_LINES = 15  # of the harness's output, shown when the check fails


def render(console: Console, report: Report) -> None:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("harness", plain(" ".join(report.harness.command)))
    head.add_row("rollout", plain(report.rollout_id))
    ended = report.harness.message or "exited with code 0"
    head.add_row("ended", plain(f"{ended} after {report.harness.seconds:.1f} s"))
    head.add_row("exercised", plain(", ".join(report.features) or "-"))
    if report.reward is not None:
        head.add_row("reward", f"{report.reward:g}")

    # the API and the model: said once above when every request shares it, else a column
    columns = []
    for name in ("api", "model"):
        values = {getattr(call, name) for call in report.calls if getattr(call, name)}
        if len(values) == 1:
            head.add_row(name, plain(next(iter(values))))
        elif values:
            columns.append(name)
    table = Table(title="requests (POST unless said) and the calls recorded", title_justify="left")
    for column in ("#", "request", "status", *columns, "tokens", "recorded", "sample"):
        table.add_column(column, overflow="fold", min_width=len(column), no_wrap=column == "request")
    for call in report.calls:
        request = f"{'' if call.method == 'POST' else call.method + ' '}{call.path}" if call.method else "(not seen)"
        table.add_row(
            str(call.number),
            plain(request),
            _status(call),
            *(plain(getattr(call, name) or "-") for name in columns),
            _tokens(call),
            _recorded(call),
            plain("-" if call.sample is None else str(call.sample)),
        )
    console.print(Panel(head, title="agl harness check", expand=False))
    console.print(table)
    for call in report.calls:
        notes = _notes(call)
        if notes:
            console.print(Text(f"#{call.number}", style="bold"), notes)

    line = Text(f"samples: {report.samples}", style="bold")
    if report.samples:
        line.append(" (")
        line.append_text(_samples(report))
        line.append(")")
    console.print(line)
    for item in report.breaks:
        line = Text(f"break: #{item.call} does not extend #{item.previous_call}: ", style="magenta")
        line.append(plain(f"{item.kind} at token {item.position} ({item.classified_by}: {item.detail})"))
        console.print(line)
        console.print(Text("    #" + str(item.previous_call) + " had: ", style="dim"), plain(_quoted(item.expected)))
        console.print(Text("    #" + str(item.call) + " sent: ", style="dim"), plain(_quoted(item.got)))
    for problem in report.problems:
        console.print(Text("problem:", style="bold red"), plain(problem))
    if not report.ok and report.harness.log_tail:
        lines = report.harness.log_tail.splitlines()[-LOG_LINES:]
        console.print(Text(f"the harness's last {len(lines)} lines of output:", style="dim"))
        for line in lines:
            console.print(plain("  " + line))
    verdict = Text("✓ " if report.ok else "✗ ", style="bold green" if report.ok else "bold red")
    verdict.append_text(plain(report.verdict, style="bold"))
    console.print(verdict)


def _tokens(call: Call) -> str:
    """prompt → completion tokens."""
    if call.prompt_tokens is None and call.completion_tokens is None:
        return "-"
    return f"{'-' if call.prompt_tokens is None else call.prompt_tokens} → {'-' if call.completion_tokens is None else call.completion_tokens}"


def _status(call: Call) -> Text:
    if call.status is None:
        return Text("-")
    style = "green" if 100 <= call.status < 400 else "red"
    return Text(str(call.status), style=style)


def _recorded(call: Call) -> Text:
    recorded = call.recorded
    if recorded is None:
        return Text("no span" if call.api else "-", style="red" if call.api else "dim")
    parts = Text()
    parts.append("token IDs" if recorded.token_ids else "no token IDs", style="green" if recorded.token_ids else "red")
    parts.append(", ")
    parts.append("logprobs" if recorded.logprobs else "no logprobs", style="green" if recorded.logprobs else "yellow")
    if recorded.policy_version is not None:
        parts.append(f", v{recorded.policy_version}")
    if recorded.agent_id:
        parts.append(", agent ")
        parts.append_text(plain(recorded.agent_id))
    if recorded.compaction:
        parts.append(", compaction", style="cyan")
    return parts


def _notes(call: Call) -> Text:
    """What a row says beyond the table: problems, refusal, unread fields, placement, the answer."""
    text = Text()

    def add(label: str, value: str, style: str = "") -> None:
        text.append(("\n    " if text else " ") + label + ": ", style=style or "dim")
        text.append_text(plain(value))

    for problem in call.problems:
        add("problem", problem, "bold red")
    if call.refused:
        add("answer", _quoted(call.refused), "red")
    for entry in call.fields_dropped:
        add("dropped", entry, "yellow")
    for entry in call.fields_passed:
        add("passed unread", entry, "yellow")
    if call.recorded is not None:
        if call.recorded.parent_agent_id:
            add("declared parent agent", call.recorded.parent_agent_id)
        if call.placement:
            add("assembly", call.placement)
        if call.answer is not None:
            add("scripted answer", _quoted(call.answer))
    return text


def _samples(report: Report) -> Text:
    threads: dict[int, list[int]] = {}
    for call in report.calls:
        if call.sample is not None:
            threads.setdefault(call.sample, []).append(call.number)
    return plain("; ".join(f"sample {s}: " + " → ".join(f"#{n}" for n in calls) for s, calls in sorted(threads.items())))


def _quoted(text: str) -> str:
    """Text on one line: newlines shown as \\n (plain() escapes any other control character)."""
    return text.replace("\r\n", "\n").replace("\n", "\\n")


# --- the compatibility table ---------------------------------------------------------------------
TABLE_HEAD = "| harness | version | features exercised | result |\n|---|---|---|---|"


def table_row(report: Report) -> str:
    """The report as one row of docs/protocols.md's compatibility table (Markdown)."""
    if report.ok:
        recorded = sum(1 for call in report.calls if call.recorded is not None)
        result = f"works: {recorded} call(s) recorded, {report.samples} sample(s)"
        if report.breaks:
            result += f", {len(report.breaks)} merge break(s)"
    else:
        result = "fails: " + report.verdict.removeprefix("does not work through agl yet: ")
    cells = [report.name, report.version or "-", ", ".join(report.features) or "-", result]
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def _cell(value: str) -> str:
    return printable(value).replace("|", "\\|")
