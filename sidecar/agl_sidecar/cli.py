"""`agl-sidecar`: the proxy a harness points its model endpoint at.

Startup imports only aiohttp, msgspec and the sidecar (litellm loads on the first call that needs
it), so the process accepts connections well under 2 s after launch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from agl_sidecar import __version__
from agl_sidecar.config import DEFAULT_LISTEN, ENV_PREFIX, ConfigError, build, env_values, load_yaml

DESCRIPTION = """\
Run beside an agent harness: it forwards OpenAI-compatible model calls to vLLM (or, through
litellm, to any provider), records each call with the engine's exact token IDs and logprobs as an
OpenTelemetry span, and can hold calls while training updates the weights.

Point the harness at http://HOST:PORT/v1, or http://HOST:PORT/rollouts/<rollout id>/v1 to attribute
its calls to a rollout. Every flag can also be set in the environment as AGL_SIDECAR_<FLAG>
(e.g. AGL_SIDECAR_OTLP_ENDPOINT; lists comma-separated) or in a YAML --config file using the
flag names with underscores (upstream: [...], otlp_endpoint: ..., sampling: {train: {temperature: 1.0}}).
Precedence: command line > environment > config file > defaults.
"""

EPILOG = """\
examples:
  agl-sidecar --upstream http://127.0.0.1:8000 --otlp-endpoint http://127.0.0.1:4318
  agl-sidecar --upstream http://gpu1:8000 --upstream http://gpu2:8000 --listen 0.0.0.0:8400 \\
      --admin-token $TOKEN --spool-dir /var/lib/agl/spool
  agl-sidecar --upstream litellm:openai/gpt-4o-mini --otlp-endpoint http://127.0.0.1:4318
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agl-sidecar",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--upstream", action="append", metavar="URL",
        help="an inference server (vLLM's base URL, e.g. http://127.0.0.1:8000) or litellm:<provider/model>; "
             "repeat for several replicas (each rollout sticks to one)")
    add("--listen", metavar="HOST:PORT", help=f"address to serve on (default {DEFAULT_LISTEN}; port 0 picks a free one)")
    add("--otlp-endpoint", metavar="URL",
        help="where spans go: an OTLP/HTTP base URL (…/v1/traces is appended) such as the trainer's receiver "
             "or a collector; for --otlp-protocol grpc, the gRPC address (http://host:4317)")
    add("--otlp-compression", choices=["gzip", "none", "auto"],
        help="compress exported spans; auto (default) gzips, except that on a loopback endpoint only "
             "requests mostly made of prompts sent before are gzipped (their compressed form is kept)")
    add("--otlp-protocol", choices=["http/protobuf", "grpc"], help="span export protocol (default http/protobuf)")
    add("--config", metavar="FILE", help="YAML file with any of these settings (keys use underscores)")
    add("--admin-token", metavar="TOKEN",
        help="bearer token for /agl/v1/* (pause, resume, state); without it only loopback clients may call them")
    add("--api-key", metavar="KEY",
        help="if set, harnesses must send 'Authorization: Bearer KEY' (keys are never logged); required off "
             "loopback unless --no-api-key (per-rollout keys, rollout_api_keys in --config, also count)")
    add("--no-api-key", action="store_true", default=None,
        help="allow listening off loopback without an API key (anyone who reaches the port can use the "
             "engine and write training data): only on a private network")
    add("--max-hold-s", type=float, metavar="S",
        help="a call held by a pause longer than this gets 503 with Retry-After (default 600)")
    add("--spool-dir", metavar="DIR",
        help="where spans wait on disk while the OTLP endpoint is down; replayed when it is back "
             "(default ~/.local/state/agl-sidecar/spool)")
    add("--durable-spans", action="store_true", default=None,
        help="write each call's span to disk (fsync) before the harness gets the call's last byte, so a "
             "killed sidecar loses no answered call's span (costs an fsync per group of concurrent calls)")
    add("--policy-version", type=int, metavar="N", help="policy version stamped on calls until a resume changes it (default 0)")
    add("--max-body-bytes", type=int, metavar="N",
        help="largest request body accepted; larger ones get 413 (default 33554432, 32 MiB)")
    add("--health-interval-s", type=float, metavar="S", help="seconds between upstream /health probes (default 5)")
    add("--header-timeout-s", type=float, metavar="S",
        help="close a connection that has not sent a whole request head this long after opening or after its "
             "last answer (also the keep-alive idle time; default 60)")
    add("--body-timeout-s", type=float, metavar="S",
        help="answer 408 and close when a request body is not whole this long after its head (default 120)")
    add("--default-mode", choices=["train", "val"],
        help="rollout mode for calls that do not say (x-agl-mode header or baggage); selects sampling overrides")
    add("--capture-messages", action="store_true", default=None,
        help="also record message text (gen_ai.input/output.messages); off by default, as the conventions ask")
    add("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity (default warning)")
    add("--version", action="version", version=f"agl-sidecar {__version__}")
    return p


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    values = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    return values


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config_path = args.config or os.environ.get(ENV_PREFIX + "CONFIG")
    try:
        file_values = load_yaml(config_path) if config_path else {}
        config = build(file_values, env_values(dict(os.environ)), _flag_values(args))
    except ConfigError as exc:
        print(f"agl-sidecar: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.otlp_endpoint is None:
        print("agl-sidecar: warning: no --otlp-endpoint; calls are proxied but their spans are not exported",
              file=sys.stderr)
    from agl_sidecar.server import serve_forever

    def ready(url: str) -> None:
        print(f"agl-sidecar listening on {url}", flush=True)

    try:
        serve_forever(config, ready)
    except OSError as exc:
        print(f"agl-sidecar: cannot listen on {config.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
