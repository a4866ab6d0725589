"""The run's wiring (agl_trainer/run/): topology, the sidecar process, settings, training from a store."""
