"""The trace viewer: `agl traces serve` and the pages a running `agl train` serves.

    from agl_trainer.viewer import serve
    server = serve("runs/agl/rollouts.db", "127.0.0.1:8500", model="Qwen/Qwen3-0.6B")
    print(server.url); ...; server.stop()

The SQL is the store's (store/queries.py, read-only); indexer.py: per-rollout summaries (versions, merge
breaks) in the background; detail.py: one rollout / one step as JSON; tokens.py: token decoding
(also used by `agl traces inspect`); server.py: the aiohttp app; static/: the page, its JS and CSS.
"""

from agl_trainer.viewer.server import ListenError, Viewer, ViewerServer, parse_listen, serve

__all__ = ["ListenError", "Viewer", "ViewerServer", "parse_listen", "serve"]
