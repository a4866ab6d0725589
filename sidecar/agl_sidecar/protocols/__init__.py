"""Front protocols the sidecar speaks besides OpenAI chat completions (translated to chat)."""
