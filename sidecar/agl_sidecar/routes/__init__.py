"""HTTP routes by who calls them: model (the harness's model calls), harness (rewards, rollout ends),
admin (the trainer and operators); common holds what they share."""
