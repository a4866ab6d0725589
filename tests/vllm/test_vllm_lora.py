"""Real vLLM (CPU build) serving LoRA: the base once, only the adapter synced (engines/vllm/lora.py).

One server for the module, started with engine.options.lora_rank (a start costs 30-140 s). The trainer's
side is peft over the same tiny model, as the torch backend wraps it (backends/lora.py); its adapters
are random, as training would leave them. The engine's logprobs after each adapter sync must equal
peft's on the same tokens; a call frozen by the keep switch and a call held by the pause both continue
under the adapter loaded meanwhile.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from agl_trainer.backends import lora
from agl_trainer.backends.torch_config import LoraConfig
from agl_trainer.engines.vllm.lora import AdapterFiles
from agl_trainer.weights.update import AdapterState, WeightUpdate

from tests.support.waiting import wait_until
from tests.vllm.conftest import SERVED_NAME, hf_token_logprobs, start_engine

pytestmark = pytest.mark.vllm

RANK = 8
PROMPT = [random.Random(0).randrange(3, 380) for _ in range(40)]  # ids >= 3: no special tokens
ATOL = 2e-4  # as test_vllm_weight_sync.py: float32 on both sides
DEVICE_STEP_MS = 20.0  # as test_vllm_keep_switch.py: slow enough for a freeze to land mid-generation


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    root = tmp_path_factory.mktemp("vllm-lora")
    # runtime loading on only for the last test, which shows why the engine does not use it
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    weights = str(root / "w")
    engine = start_engine(
        tiny_model_dir, vllm_python, root / "logs", lora_rank=RANK, weights_dir=weights, env=env
    )
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """The trainer's model: the base wrapped with peft (every linear layer of a block adapted)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return lora.wrap(base, LoraConfig(rank=RANK, alpha=16.0)).eval()


def set_adapter(model, seed: int) -> AdapterState:  # type: ignore[no-untyped-def]
    """Random A and B, as training would leave them (B = 0 is the base)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return lora.adapter_state(model)


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    """The trainer's logprobs: peft's forward (base + B A x scaling, not merged), as the backend's."""
    return hf_token_logprobs(model, prompt, tokens)


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> Sample:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return Sample(choice["token_ids"], choice["logprobs"]["token_logprobs"])


def loads(engine) -> int:  # type: ignore[no-untyped-def]
    """How often the worker has read an adapter from disk (the first call starts counting)."""
    reply = httpx.post(f"{engine.urls[0]}/collective_rpc", json={"method": "agl_adapter_loads"}, timeout=60)
    return int(reply.json()["results"][0])


def far(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_model_name_serves_the_base_until_the_first_sync(engine, trainer) -> None:  # type: ignore[no-untyped-def]
    (url,) = engine.urls
    cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}
    base_name = f"{SERVED_NAME}-base"
    assert set(cards) == {SERVED_NAME, base_name} and cards[SERVED_NAME]["parent"] == base_name
    sample = complete(url, PROMPT)
    with trainer.disable_adapter():
        assert sample.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, sample.tokens), abs=ATOL)


def test_adapter_syncs_give_the_trainers_logprobs(engine, trainer) -> None:  # type: ignore[no-untyped-def]
    (url,) = engine.urls
    loads(engine)
    first = set_adapter(trainer, seed=1)
    seconds = engine.update_weights(WeightUpdate(version=1, adapter=first))
    after_first = complete(url, PROMPT, max_tokens=40)  # 40 engine steps with the adapter
    assert after_first.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, after_first.tokens), abs=ATOL)
    with trainer.disable_adapter():
        base = logprobs_of(trainer, PROMPT, after_first.tokens)
    assert far(after_first.logprobs, base) > 100 * ATOL  # the adapter is applied, not the base served
    report = engine.last_sync
    assert report.adapter and report.nbytes == first.nbytes == engine.last_update_bytes
    print(f"\nvllm lora sync: {first.nbytes} bytes in {seconds:.3f} s (write {report.write_seconds:.4f} s, "
          f"worker load {report.load_seconds[0]:.4f} s, "
          f"server {report.server_seconds[0]:.3f} s)")  # fmt: skip

    second = set_adapter(trainer, seed=2)
    engine.update_weights(WeightUpdate(version=2, adapter=second))
    after_second = complete(url, PROMPT, max_tokens=40)
    assert after_second.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, after_second.tokens), abs=ATOL)
    first_model_logprobs = _with_adapter(trainer, first, PROMPT, after_second.tokens)
    assert far(after_second.logprobs, first_model_logprobs) > 100 * ATOL  # not the first adapter's
    # one read per sync: the served adapter is never re-read per step (vllm/lora.py: load_inplace)
    assert loads(engine) == 2
    root = Path(engine.config.options.weights_dir) / "lora"
    assert sorted(p.name for p in root.iterdir()) == ["current", "v0-empty", "v2"]
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "2"}


def _with_adapter(model, state: AdapterState, prompt: list[int], tokens: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    saved = lora.adapter_state(model)
    lora.load_adapter_weights(model, state.weights)
    try:
        return logprobs_of(model, prompt, tokens)
    finally:
        lora.load_adapter_weights(model, saved.weights)


def stream(url: str, prompt: list[int], max_tokens: int, events: list[dict]) -> None:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))


def token_ids(events: list[dict]) -> list[int]:
    return [t for e in events for c in e["choices"] for t in c["token_ids"] or []]


@pytest.mark.parametrize("switch_kv", ["recompute", "keep"])
def test_calls_frozen_or_held_across_an_adapter_update_continue_under_it(engine, trainer, switch_kv: str) -> None:  # type: ignore[no-untyped-def]
    """loop.switch keep: a generation frozen mid-way and a call that arrived during the freeze (vLLM
    holds it) both finish under the new adapter; the frozen one's prefix recomputed by it
    (switch_kv recompute) or its KV cache kept from the old adapter (keep), as with full weights."""
    (url,) = engine.urls
    old = set_adapter(trainer, seed=3)
    engine.update_weights(WeightUpdate(version=3, adapter=old))
    new = set_adapter(trainer, seed=4)
    events: list[dict] = []
    held: list[Sample] = []
    # a prompt no earlier call cached: with switch_kv keep the prefix cache cannot be emptied while the
    # frozen call holds blocks (VLLMOptions.switch_kv), for adapters as for full weights
    fresh = [random.Random(7).randrange(3, 380) for _ in range(40)]
    engine.config.options.switch_kv = switch_kv
    engine.set_device_step_ms(DEVICE_STEP_MS)
    try:
        frozen = threading.Thread(target=stream, args=(url, PROMPT[:20], 200, events))
        frozen.start()
        wait_until(lambda: len(token_ids(events)) >= 60, "60 tokens", 300)
        progress = engine.freeze()
        arriving = threading.Thread(target=lambda: held.append(complete(url, fresh, max_tokens=8)))
        arriving.start()
        time.sleep(1.0)  # it reaches vLLM, which holds it while paused
        assert not held
        engine.update_weights(WeightUpdate(version=4, adapter=new))
        engine.thaw()
        frozen.join(300)
        arriving.join(300)
    finally:
        engine.set_device_step_ms(0.0)
        engine.config.options.switch_kv = "recompute"

    (boundary,) = [n for rid, n in progress.items() if rid.startswith(events[0]["id"] + "-")]
    tokens = token_ids(events)
    chunks = [c["logprobs"] for e in events for c in e["choices"] if c["logprobs"]]
    logprobs = [p for chunk in chunks for p in chunk["token_logprobs"]]
    prompt = PROMPT[:20]
    assert len(tokens) == len(logprobs) == 200 and 60 <= boundary < 200
    before = _with_adapter(trainer, old, prompt, tokens[:boundary])
    assert logprobs[:boundary] == pytest.approx(before, abs=ATOL)
    recomputed = logprobs_of(trainer, prompt, tokens)[boundary:]  # the new adapter over everything
    if switch_kv == "recompute":
        assert logprobs[boundary:] == pytest.approx(recomputed, abs=ATOL)
    else:
        after = _over_old_kv(trainer, old, new, prompt, tokens, boundary)
        assert logprobs[boundary:] == pytest.approx(after, abs=ATOL)
        assert far(logprobs[boundary:], recomputed) > 10 * ATOL  # the old KV mattered
    (late,) = held
    assert late.logprobs == pytest.approx(logprobs_of(trainer, fresh, late.tokens), abs=ATOL)


def _over_old_kv(model, old, new, prompt: list[int], tokens: list[int], boundary: int) -> list[float]:  # type: ignore[no-untyped-def]
    """The old adapter's KV cache up to the last old token, then the new adapter (switch_kv keep)."""
    try:
        with torch.no_grad():
            lora.load_adapter_weights(model, old.weights)
            cache = model(torch.tensor([prompt + tokens[: boundary - 1]]), use_cache=True).past_key_values
            lora.load_adapter_weights(model, new.weights)
            rest = torch.tensor([tokens[boundary - 1 : -1]])
            logits = model(rest, past_key_values=cache, use_cache=True).logits
    finally:
        lora.load_adapter_weights(model, new.weights)
    chosen = torch.tensor(tokens[boundary:])[:, None]
    return logits.float().log_softmax(-1)[0].gather(1, chosen)[:, 0].tolist()


def assert_prompt_logprobs_are(url: str, model: Any) -> None:
    """The canary's request (several prompts scored with prompt_logprobs) answers `model`'s logprobs."""
    probes = [PROMPT[:24], PROMPT[10:40], PROMPT[5:12]]
    body = {"model": SERVED_NAME, "prompt": probes, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    assert reply.status_code == 200, reply.text
    for choice in reply.json()["choices"]:
        probe, scored = probes[choice["index"]], choice["prompt_logprobs"]
        got = [scored[i][str(probe[i])]["logprob"] for i in range(1, len(probe))]
        assert got == pytest.approx(logprobs_of(model, probe[:1], probe[1:]), abs=ATOL)


def test_prompt_logprobs_on_the_adapter_are_the_trainers(engine, trainer) -> None:  # type: ignore[no-untyped-def]
    """The canary's request (loop/canary.py): several prompts scored with prompt_logprobs. vLLM 0.32 with
    LoRA on dies on it unless the worker skips the output head's zero LoRA delta (vllm/worker.py)."""
    (url,) = engine.urls
    engine.update_weights(WeightUpdate(version=5, adapter=set_adapter(trainer, seed=8)))
    assert_prompt_logprobs_are(url, trainer)
    assert len(complete(url, PROMPT).tokens) == 8  # and the server lives on


def test_an_adapter_on_the_tied_output_head_gives_the_trainers_logprobs(  # type: ignore[no-untyped-def]
    engine, trainer, tiny_model_dir: Path
) -> None:
    """lm_head adapted on the tied model (backends/lora.py: the head's output alone): sampled and prompt
    logprobs (several prompts, as the canary's; the worker gives each prompt row its token's LoRA slot)
    are peft's; the next adapter, without the head, leaves the head's slot at zero again."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    targets = (*LoraConfig().target_modules, "lm_head")
    headed = lora.wrap(base, LoraConfig(rank=RANK, alpha=16.0, target_modules=targets)).eval()
    adapter = set_adapter(headed, seed=9)
    assert any(".lm_head.lora_B" in name for name in adapter.weights)
    (url,) = engine.urls
    engine.update_weights(WeightUpdate(version=7, adapter=adapter))
    sample = complete(url, PROMPT, max_tokens=16)
    assert sample.logprobs == pytest.approx(logprobs_of(headed, PROMPT, sample.tokens), abs=ATOL)
    with headed.disable_adapter():  # the head adapter moves the logprobs well past the tolerance
        assert far(sample.logprobs, logprobs_of(headed, PROMPT, sample.tokens)) > 100 * ATOL
    assert_prompt_logprobs_are(url, headed)
    engine.update_weights(WeightUpdate(version=8, adapter=set_adapter(trainer, seed=10)))  # no head
    again = complete(url, PROMPT)
    assert again.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, again.tokens), abs=ATOL)


def test_full_weights_on_a_lora_engine_are_the_base_again(engine, trainer, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    (url,) = engine.urls
    engine.update_weights(WeightUpdate(version=9, directory=tiny_model_dir))
    sample = complete(url, PROMPT)
    with trainer.disable_adapter():
        assert sample.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, sample.tokens), abs=ATOL)
    assert (Path(engine.config.options.weights_dir) / "lora" / "current").resolve().name == "v0-empty"


def test_vllms_own_load_inplace_would_reread_the_adapter_every_step(engine, trainer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Why the engine loads through its worker extension (vllm/lora.py), and a canary for a vLLM upgrade
    that changes it; last in the module (it leaves the flag on the served adapter). vLLM 0.32's
    POST /v1/load_lora_adapter with load_inplace stores the flag in the served LoRARequest: every later
    request carries it, and the worker re-reads the adapter from that request's path at each step (a
    frozen request, from the old path: the old adapter, or an error once that directory is gone)."""
    (url,) = engine.urls
    state = set_adapter(trainer, seed=5)
    probe = AdapterFiles(tmp_path / "probe", RANK, Path(engine.config.model))
    directory, _ = probe.write(1, state.weights, state.config)
    body = {"lora_name": SERVED_NAME, "lora_path": str(directory), "load_inplace": True}
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    before = loads(engine)
    sample = complete(url, PROMPT, max_tokens=20)
    assert sample.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, sample.tokens), abs=ATOL)
    assert loads(engine) - before >= 19  # one read per engine step of the 20-token call


def test_a_restarted_server_serves_the_latest_adapter(engine, trainer) -> None:  # type: ignore[no-untyped-def]
    """Last: it costs a second server start. The new server registers `current` (the latest adapter)
    at its start and is given it again under its new vLLM id."""
    import os
    import signal

    (url,) = engine.urls
    latest = set_adapter(trainer, seed=6)
    engine.update_weights(WeightUpdate(version=10, adapter=latest))
    process = engine._servers[0].process
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)

    assert engine.ensure_alive() == [url]
    sample = complete(url, PROMPT)
    assert sample.logprobs == pytest.approx(logprobs_of(trainer, PROMPT, sample.tokens), abs=ATOL)
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "10"}
