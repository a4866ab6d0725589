"""A harness that never calls a model through agl (it ignores OPENAI_BASE_URL)."""

print("done without a model")
