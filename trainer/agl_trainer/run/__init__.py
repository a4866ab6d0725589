"""The wiring of one process: what builds the parts from the config and starts them.

- session.Session: one `agl train` run: receiver + store, engine, sidecar subprocess, runners,
  backend, the loop with live rollouts; or, `--from-store`, the backend and the store read; Ctrl-C
  and --resume
- build: each part built from the config; settings: the backend's and engine's settings
- serving, servers, fleet, sidecar_client, dataplane, topology: the processes and their addresses
"""
