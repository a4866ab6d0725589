"""The vLLM engine: vLLM OpenAI servers, managed or attached, with weight sync in place
(engine.py, VLLMEngine). Importing the package imports nothing: config.py stays light for
`agl train --dry-run`; worker.py runs inside vLLM's interpreter, not this one."""
