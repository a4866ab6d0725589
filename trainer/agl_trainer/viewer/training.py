"""The viewer a running `agl train` serves over its own store (config section `viewer`).

Best effort: the viewer never stops a run. A busy port falls back to a free one; any other
failure is printed and training goes on without it. Off loopback it is served only with a token
(`viewer.token_env`, the same rule as `agl traces serve`): without one it is not started.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from agl_trainer.viewer.access import AccessError, check_listen
from agl_trainer.viewer.server import ListenError, Viewer, ViewerServer, parse_listen

INDEX_DUTY = 0.25  # the viewer's indexer beside a training loop: at most a quarter of the time


def start_for_training(
    store_path: Path, listen: str, model: str | None, run_dir: Path, token_env: str = "AGL_VIEWER_TOKEN"
) -> ViewerServer | None:
    token = os.environ.get(token_env) or None
    try:
        host, port = parse_listen(listen)
        check_listen(host, token, False, f"export {token_env}=<a secret>, or viewer.listen on 127.0.0.1")
    except (ListenError, AccessError) as error:
        print(f"agl: viewer.listen: {error}; the trace viewer is off for this run", file=sys.stderr)
        return None
    for attempt_port in (port, 0) if port else (0,):
        try:
            viewer = Viewer(store_path, model=model, run_dir=run_dir, index_duty=INDEX_DUTY, token=token)
            server = ViewerServer(viewer, f"[{host}]:{attempt_port}" if ":" in host else f"{host}:{attempt_port}")
            server.start()
        except OSError as error:
            if error.errno == errno.EADDRINUSE and attempt_port:
                continue
            print(f"agl: the trace viewer could not start ({error}); training goes on", file=sys.stderr)
            return None
        except Exception as error:  # noqa: BLE001 (the viewer is optional: report, never stop training)
            print(f"agl: the trace viewer could not start ({error}); training goes on", file=sys.stderr)
            return None
        print(f"agl: trace viewer at {server.url} (viewer.enabled: false turns it off)", file=sys.stderr, flush=True)
        return server
    return None
