"""The fake vLLM's sampled texts: a function of (prompt, seed, choice index) alone, the same in every
process (tests compare a stream with what another process, or a later request, got), and never a
single token (a stream test needs more than one piece)."""

from __future__ import annotations

import json
import subprocess
import sys

from agl_testing.fake_vllm import _Sample, chat_prompt_ids

PROBE = """
import json, sys
from agl_testing.fake_vllm import _Sample, chat_prompt_ids
prompt = chat_prompt_ids([{"role": "user", "content": "Tell me a story"}])
bodies = ({"max_tokens": 40}, {"max_tokens": 40, "seed": 7})
print(json.dumps([_Sample(body, prompt, i, None).text for body in bodies for i in (0, 1)]))
"""


def texts_in_a_new_process() -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_an_unseeded_request_gets_the_same_text_in_every_process() -> None:
    # hash(None), once part of the RNG's seed, is an address in CPython 3.11: each process drew anew
    first, second = texts_in_a_new_process(), texts_in_a_new_process()
    assert first == second
    prompt = chat_prompt_ids([{"role": "user", "content": "Tell me a story"}])
    assert first[0] == _Sample({"max_tokens": 40}, prompt, 0, None).text  # and in this one
    assert len(set(first)) == 4  # choices and seeds still differ


def test_every_text_is_at_least_two_words() -> None:
    for n in range(300):
        prompt = chat_prompt_ids([{"role": "user", "content": f"question {n}"}])
        sample = _Sample({"max_tokens": 64}, prompt, 0, None)
        assert len(sample.text.split(" ")) >= 2 and len(sample.token_ids) > 2
