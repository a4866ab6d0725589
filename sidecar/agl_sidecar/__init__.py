"""agl-sidecar: the proxy a harness points its model endpoint at."""

__version__ = "0.1.0"
