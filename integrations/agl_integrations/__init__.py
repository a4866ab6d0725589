"""Thin adapters that point harness frameworks at the agl sidecar."""
