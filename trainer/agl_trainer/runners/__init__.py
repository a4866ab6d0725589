"""Runners start the harness once per rollout, pointed at the sidecar with the rollout's prefix.

- local.CommandRunner: a command per rollout, as a local process group (timeout kills the group)
- workers.FunctionRunner: `module:function` called per rollout in long-lived worker processes
- kubernetes.KubernetesRunner: a Kubernetes Job per rollout through the official client:
  kubernetes_config (the Job template's keys), kubernetes_manifest (manifests, checked against the
  client's OpenAPI models), kubernetes_watch (watch + periodic list), kubernetes_status (a Job's
  outcome, a pod that never starts); ratelimit.py paces Job creation

All report how a harness ended (runners.base.RolloutOutcome) and retry infrastructure failures only.
"""
