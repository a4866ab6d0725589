"""Runners start the harness once per rollout, pointed at the sidecar with the rollout's prefix.

- local.CommandRunner: a command per rollout, as a local process group (timeout kills the group)
- workers.FunctionRunner: `module:function` called per rollout in long-lived worker processes
- kubernetes.KubernetesRunner: a Kubernetes Job per rollout (manifests: build_job_manifest)

All report how a harness ended (runners.base.RolloutOutcome) and retry infrastructure failures only.
"""
