"""One model call as the sidecar sees it, shared by the proxy (which fills it in) and the span
pipeline (which builds its span): the record, whom it belongs to (attribution), the engine's wire
format, and the policy switches it may run across. Imports neither proxy/ nor spans/."""
