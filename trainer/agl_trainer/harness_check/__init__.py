"""`agl harness check -- COMMAND ...`: will a harness work through agl?

It runs the command once, as a runner would (the rollout's sidecar URL and ids in its environment),
against a fresh sidecar in front of a scripted engine, with a receiver and a store in a folder of
its own; then it says, call by call, what the harness got and what agl recorded, and whether the
calls merge into one sample.

    chatml.py   the scripted engine's tokenizer (bytes) and chat template (ChatML, tool calls, reasoning)
    script.py   the scripted turns (`--script FILE`) and the default answer
    engine.py   the scripted engine: vLLM's wire format, token IDs and logprobs
    tap.py      a recording proxy between the harness and the sidecar: each request's path and status
    features.py what a request exercises (streaming, tools, tool results, reasoning, ...)
    report.py   the report: exchanges matched to recorded calls, assembly's samples and breaks, verdict
    check.py    the run: the parts started, the command run, the spans drained, the report built
    render.py   the report for a terminal, and the compatibility table's rows
"""
