"""`agl receive`: collect OTLP traces into a rollout store, to train on later or to inspect."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading

from agl import semconv

from agl_trainer.addresses import is_loopback
from agl_trainer.cli import CLIError

TOKEN_ENV = semconv.ENV_RECEIVER_TOKEN


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "receive",
        help="collect OTLP traces (HTTP and gRPC) into a rollout store",
        description=(
            "Run the trainer's OTLP receiver on its own: spans sent to POST /v1/traces (protobuf or JSON,"
            " gzip) or OTLP/gRPC are stored in the SQLite rollout store, each batch committed before it is"
            " acknowledged. Log records sent to POST /v1/logs (or the gRPC LogsService) are read for one event,"
            " gen_ai.evaluation.result (a reward; docs/spans.md); others are ignored. Point the sidecar"
            " (or a collector) at the printed URL. Inspect with `agl traces`."
        ),
        epilog="example: agl receive --store runs/traces.db --listen 0.0.0.0:4318 --grpc-listen 0.0.0.0:4317",
    )
    parser.add_argument("--store", required=True, help="SQLite rollout store (created if missing)")
    parser.add_argument(
        "--listen", default="127.0.0.1:4318", help="HOST:PORT for OTLP/HTTP (port 0: any free)"
    )
    parser.add_argument("--grpc-listen", default=None, help="HOST:PORT for OTLP/gRPC (off unless given)")
    parser.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        help=f"environment variable holding a bearer token to require (default {TOKEN_ENV}; unset: no token)",
    )
    parser.add_argument(
        "--no-token",
        action="store_true",
        help="allow listening off loopback without a token (anyone who reaches the port can write spans)",
    )
    parser.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body, as sent")
    parser.add_argument("--max-decompressed-mb", type=float, default=256.0, help="largest body after gzip")
    parser.add_argument(
        "--header-timeout-s", type=float, default=30.0,
        help="close a connection whose request head has not all arrived by then (a half-sent request)",
    )  # fmt: skip
    parser.add_argument(
        "--body-timeout-s", type=float, default=120.0,
        help="answer 408 to a request whose body has not all arrived by then, after its head",
    )  # fmt: skip
    parser.add_argument(
        "--durability",
        choices=("full", "normal"),
        default="full",
        help="full: a commit survives power loss (fsync per commit); normal: survives a process crash only",
    )
    parser.set_defaults(run=run)


def parse_address(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise CLIError(f"{flag} {value!r}: expected HOST:PORT, e.g. 127.0.0.1:4318 (port 0 picks a free one)")
    return host.strip("[]"), int(port)


def run(args: argparse.Namespace) -> int:
    from agl_trainer.receiver import Receiver, ReceiverConfig
    from agl_trainer.store import StoreError

    host, port = parse_address(args.listen, "--listen")
    grpc_host, grpc_port = (
        parse_address(args.grpc_listen, "--grpc-listen") if args.grpc_listen else ("", None)
    )
    for flag, value in (("--max-request-mb", args.max_request_mb), ("--max-decompressed-mb", args.max_decompressed_mb)):
        if not (math.isfinite(value) and 0 < value <= 1 << 20):  # nan or inf would be a traceback below
            raise CLIError(f"{flag} {value}: expected a size in MB, > 0 and at most 1048576")
    for flag, value in (("--header-timeout-s", args.header_timeout_s), ("--body-timeout-s", args.body_timeout_s)):
        if not (math.isfinite(value) and 0 < value <= 86_400):
            raise CLIError(f"{flag} {value}: expected seconds, > 0 and at most 86400")
    token = os.environ.get(args.token_env) or None
    if token is None and not args.no_token and not (is_loopback(host) and (grpc_host == "" or is_loopback(grpc_host))):
        raise CLIError(
            f"--listen {args.listen}{' / --grpc-listen ' + args.grpc_listen if args.grpc_listen else ''} is not "
            f"loopback and {args.token_env} is not set: anyone who reaches the port could write training data "
            f"(fix: export {args.token_env}=<a secret> and give senders 'authorization: Bearer <it>', "
            "or pass --no-token on a private network)"
        )
    config = ReceiverConfig(
        host=host,
        port=port,
        grpc_host=grpc_host or "127.0.0.1",
        grpc_port=grpc_port,
        token=token,
        max_request_bytes=int(args.max_request_mb * (1 << 20)),
        max_decompressed_bytes=int(args.max_decompressed_mb * (1 << 20)),
        durability=args.durability,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
    )
    try:
        receiver = Receiver(args.store, config).start()
    except StoreError as error:
        raise CLIError(str(error)) from None
    except OSError as error:
        raise CLIError(f"cannot listen: {error}") from None
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"agl receive: OTLP/HTTP on {receiver.url}/v1/traces", flush=True)
    if receiver.grpc_address:
        print(f"agl receive: OTLP/gRPC on {receiver.grpc_address}", flush=True)
    print(
        f"agl receive: storing into {args.store}{' (bearer token required)' if config.token else ''}",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        receiver.stop()
        stats = receiver.stats()
        print(
            f"agl receive: stopped; {stats.stored} spans stored, {stats.duplicates} duplicates,"
            f" {sum(stats.violations.values())} breaking the contract, {sum(stats.bad_requests.values())}"
            " requests refused",
            file=sys.stderr,
        )
    return 0
