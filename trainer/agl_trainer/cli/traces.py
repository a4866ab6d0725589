"""`agl traces`: import, list and inspect what a rollout store holds.

Ids, task ids and reasons come from harnesses and senders: they are printed through
`agl_trainer.printable.printable` (control characters as visible escapes) and never as rich markup.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from agl import semconv

from agl_trainer.cli import CLIError
from agl_trainer.console import make_console

VIEWER_TOKEN_ENV = semconv.ENV_VIEWER_TOKEN


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "traces",
        help="import, list and inspect stored traces",
        description="Work with a rollout store: import OTLP JSON lines, list rollouts, inspect one.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    imp = commands.add_parser(
        "import",
        help="import OTLP JSON lines (an OpenTelemetry Collector file exporter's output)",
        description="Import a file with one OTLP ExportTraceServiceRequest JSON object per line (.gz ok)."
        " Spans already in the store are skipped, so importing twice is safe.",
    )
    imp.add_argument("file", type=Path)
    imp.add_argument("--store", required=True, help="SQLite rollout store (created if missing)")
    imp.set_defaults(run=run_import)

    ls = commands.add_parser(
        "ls", help="list rollouts with their status", description="List rollouts, oldest first."
    )
    ls.add_argument("--store", required=True)
    ls.add_argument("--limit", type=int, default=50, help="show at most this many, the newest (default 50)")
    ls.add_argument("--all", action="store_true", help="show every rollout (slow on a big store)")
    ls.add_argument(
        "--grace-s", type=float, default=2.0, help="grace period after a rollout ends (default 2)"
    )
    ls.set_defaults(run=run_ls)

    inspect = commands.add_parser(
        "inspect",
        help="show one rollout: calls, trained and masked tokens, merge boundaries, rewards",
        description="Assemble one rollout as the trainer would and show it. Without ROLLOUT_ID, the most"
        " recently completed rollout. ROLLOUT_ID may be a unique prefix.",
    )
    inspect.add_argument("rollout_id", nargs="?", default=None, metavar="ROLLOUT_ID")
    inspect.add_argument("--store", required=True)
    inspect.add_argument("--attempt", type=int, default=None, help="which attempt (default: the latest)")
    inspect.add_argument(
        "--tokenizer",
        "--model",
        default=None,
        help="a model or tokenizer directory, to decode tokens to text (default: the model in the run's"
        " config.yaml beside the store, when it is still there)",
    )
    inspect.add_argument("--reward-name", default=None, help="the reward trained on (default: reward)")
    inspect.add_argument(
        "--max-tokens", type=int, default=600, help="tokens shown per sample (middle elided)"
    )
    inspect.set_defaults(run=run_inspect)

    serve = commands.add_parser(
        "serve",
        help="browse a store in a web browser: rollouts, calls, decoded tokens, merge breaks, steps",
        description="Serve the trace viewer over a rollout store (read-only; safe while `agl train` writes"
        " it). Open the printed address in a browser.",
    )
    serve.add_argument("--store", required=True, help="the SQLite rollout store (e.g. runs/agl/rollouts.db)")
    serve.add_argument(
        "--model",
        default=None,
        help="a model or tokenizer directory, to decode tokens to text (default: the model in the run's"
        " config.yaml beside the store, when it is still there)",
    )
    serve.add_argument("--listen", default="127.0.0.1:8500", help="HOST:PORT to serve on (default 127.0.0.1:8500)")
    serve.add_argument(
        "--run-dir", type=Path, default=None, help="the run's output dir, for metrics.jsonl and harness logs"
        " (default: the store's folder)"
    )
    serve.add_argument("--reward-name", default=None, help="the reward trained on (default: reward)")
    serve.add_argument(
        "--token",
        default=None,
        help="require this token (clients send 'Authorization: Bearer <token>'; a browser opens /?token=<token>"
        " once); default: the variable named by --token-env. Needed off loopback",
    )
    serve.add_argument(
        "--token-env",
        default=VIEWER_TOKEN_ENV,
        help=f"environment variable holding the token when --token is not given (default {VIEWER_TOKEN_ENV})",
    )
    serve.add_argument(
        "--no-token",
        action="store_true",
        help="allow listening off loopback without a token (anyone who reaches the port reads the store)",
    )
    serve.set_defaults(run=run_serve)

    parser.set_defaults(run=lambda args: (parser.print_help(), 2)[1])


def _open_store(path: str, must_exist: bool = True, **kwargs):
    from agl_trainer.store import RolloutStore, StoreError

    if must_exist and not Path(path).exists():
        raise CLIError(
            f"no store at {path}; collect traces with `agl receive --store {path}` or `agl traces import`"
        )
    try:
        return RolloutStore(path, **kwargs)
    except StoreError as error:
        raise CLIError(str(error)) from None


def run_import(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from agl_trainer.receiver.importer import import_jsonl

    if not args.file.is_file():
        raise CLIError(f"{args.file}: no such file")
    store = _open_store(args.store, must_exist=False)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as progress:
        task = progress.add_task(f"importing {args.file.name}", total=args.file.stat().st_size)
        result = import_jsonl(store, args.file, progress=lambda n: progress.advance(task, n))
    store.close()
    print(
        f"imported {args.file}: {result.lines} lines, {result.spans} spans, {result.stored} stored,"
        f" {result.duplicates} already there, {result.foreign} not agl's"
    )
    from agl_trainer.printable import printable

    for reason, count in sorted(result.violations.items()):
        print(f"  {count} span(s) break the span contract: {printable(reason)}")
    for number, reason in result.bad_lines[:20]:
        print(f"  line {number}: {printable(reason)}")
    if result.bad_lines:
        print(f"agl: {len(result.bad_lines)} line(s) could not be read and were not imported")
        return 1
    return 0


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def run_ls(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from agl_trainer.printable import plain, printable
    from agl_trainer.store.queries import shown_mode

    if args.limit < 1:
        raise CLIError(f"--limit must be 1 or more, got {args.limit} (or --all for every rollout)")
    store = _open_store(args.store, grace_s=args.grace_s)
    rollouts = store.rollouts() if args.all else store.rollouts(args.limit, newest=True)
    stats = store.stats()
    store.close()
    now = time.time()
    table = Table(
        title=plain(
            f"{len(rollouts)} of {stats.rollouts} rollouts in {args.store}"
            + (" (the newest; --limit N or --all for more)" if len(rollouts) < stats.rollouts else "")
        ),
        title_justify="left",
    )
    table.add_column("rollout", overflow="fold", min_width=12)  # ids are never cut: users copy them
    for column in ("attempt", "task", "mode", "status", "cause", "calls", "rewards", "training", "last span"):
        table.add_column(column)
    for r in rollouts:
        training = (
            f"step {r.trained_step}"
            if r.trained_step is not None
            else f"dropped ({r.dropped_reason})"
            if r.dropped_reason
            else "ready"
            if r.complete
            else "-"
        )
        status = "complete" if r.complete else "open"
        cause_style = "green" if r.end_cause == "ok" else "red" if r.end_cause else ""
        table.add_row(
            plain(r.rollout_id),
            str(r.attempt),
            plain(r.task_id or "-"),
            plain(shown_mode(r.mode, r.dropped_reason)),
            status,
            plain(r.end_cause or "-", style=cause_style),
            str(r.calls),
            str(r.rewards),
            plain(training),
            _age(now - r.last_span_at) + " ago",
        )
    console = make_console()
    console.print(table)
    console.print(
        plain(
            f"{stats.complete} complete ({', '.join(f'{k} {v}' for k, v in sorted(stats.by_cause.items())) or '-'}),"
            f" {stats.ready} ready, {stats.trained} trained, {stats.dropped} dropped; {stats.calls} calls,"
            f" {stats.rewards} rewards; last step {stats.last_step if stats.last_step is not None else '-'}"
        )
    )
    for reason, count in sorted(stats.violations.items()):
        console.print(f"[red]{count} span(s) break the span contract: {escape(printable(reason))}[/]")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from agl_trainer.assembly import AssemblyConfig, assemble_rollout
    from agl_trainer.assembly.inspect_view import printable, render

    store = _open_store(args.store)
    try:
        if args.rollout_id is None:
            done = [r for r in store.rollouts() if r.complete] or store.rollouts()
            if not done:
                raise CLIError(f"{args.store} holds no rollouts yet")
            info = max(done, key=lambda r: (r.completed_at or 0.0, r.last_span_at))
        else:
            matches = store.find(args.rollout_id)
            exact = [r for r in matches if r.rollout_id == args.rollout_id]
            matches = exact or matches
            if args.attempt is not None:
                matches = [r for r in matches if r.attempt == args.attempt]
            ids = sorted({r.rollout_id for r in matches})
            if not ids:
                raise CLIError(
                    f"no rollout matches '{printable(args.rollout_id)}';"
                    f" list them with `agl traces ls --store {args.store}`"
                )
            if len(ids) > 1:
                shown = ", ".join(printable(rollout_id) for rollout_id in ids[:5])
                raise CLIError(
                    f"'{printable(args.rollout_id)}' matches {len(ids)} rollouts ({shown}...); give more of the id"
                )
            info = max(matches, key=lambda r: r.attempt)
        tokenizer = None
        if args.tokenizer:
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
            except Exception as error:  # noqa: BLE001 (any loading failure is a user error here)
                raise CLIError(f"--tokenizer {args.tokenizer}: cannot load a tokenizer: {error}") from None
        else:  # the run's own model, as the viewer finds it (its config.yaml beside the store)
            from agl_trainer.viewer.run_model import run_model
            from agl_trainer.viewer.tokens import TokenizerError, load_tokenizer

            found = run_model(Path(args.store).parent)
            if found is not None:
                try:
                    tokenizer = load_tokenizer(found)
                except TokenizerError:
                    tokenizer = None  # token ids, as without a model
        config = AssemblyConfig(reward_name=args.reward_name) if args.reward_name else AssemblyConfig()
        data = store.load(info.key)
        render(
            make_console(), data, assemble_rollout(data, config, tokenizer), tokenizer, max_tokens=args.max_tokens
        )
    finally:
        store.close()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from agl_trainer.viewer import ListenError, Viewer, ViewerServer, parse_listen
    from agl_trainer.viewer.access import AccessError, check_listen
    from agl_trainer.store.queries import QueryError

    token = args.token or os.environ.get(args.token_env) or None
    try:
        host, _ = parse_listen(args.listen)
        check_listen(
            host, token, args.no_token, f"export {args.token_env}=<a secret> (or --token), or --no-token on a private network"
        )
    except AccessError as error:
        raise CLIError(f"--listen {args.listen}: {error}") from None
    except ListenError as error:
        raise CLIError(f"{error} (fix: --listen is HOST:PORT)") from None
    try:
        viewer = Viewer(
            Path(args.store), model=args.model, run_dir=args.run_dir, reward_name=args.reward_name, token=token
        )
    except QueryError as error:
        raise CLIError(f"{error} (fix: --store names a rollout store)") from None
    if args.model and not viewer.decoder().decodes:  # load it now: a wrong path is said before serving
        viewer.close()
        raise CLIError(f"--model: {viewer.tokenizer_error} (fix: a model or tokenizer directory)")
    try:
        server = ViewerServer(viewer, args.listen, allow_no_token=args.no_token).start()
    except OSError as error:
        raise CLIError(f"cannot listen on {args.listen}: {error.strerror or error} (fix: --listen HOST:PORT)") from None
    guarded = " (token required)" if token else ""
    decoding = (
        f"; tokens decoded with {viewer.model} ({'--model' if args.model else viewer.model_source})"
        if viewer.model
        else "; tokens shown as ids (--model DIR decodes them)"
    )
    print(f"agl traces: serving {args.store} at {server.url}{guarded}{decoding} (Ctrl-C stops)", flush=True)
    import threading

    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
