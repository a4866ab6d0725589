"""The parts of scripts/gpu_check.sh that need CUDA (`gpu` marker): the chunked log-probs on a GPU
(close to the whole computation, less memory), and the embedded engine on CUDA answering as on the
CPU. Without a GPU: the RL run's pieces that the CPU can check (its config passes `agl train
--dry-run`, its summary follows its definitions, the engine refuses CUDA it does not have)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from agl_trainer.algorithms import token_entropy, token_logprobs
from agl_trainer.backends.chunked_logprobs import token_outputs
from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions

ROOT = Path(__file__).resolve().parents[2]
on_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def post_json(url: str, body: dict) -> dict:
    """The standard library's HTTP: what the gpu tests import must be on a bare CUDA image."""
    import json
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def bench(name: str) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_logprobs_on_cuda_close_to_whole_and_smaller():
    """On CUDA the chunks' reductions may run in another order than the whole's (no bit-for-bit
    promise there), so: equal within bf16 rounding, and the peak is the chunk's, not the whole's."""
    positions, hidden, vocab = 4096, 896, 151_936
    generator = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(positions, hidden, device="cuda", generator=generator)
    weight = 0.02 * torch.randn(vocab, hidden, device="cuda", generator=generator)
    labels = torch.randint(0, vocab, (positions,), device="cuda", generator=generator)
    outputs, peaks = [], []
    for chunked in (False, True):
        x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logits = F.linear(x.bfloat16(), w.bfloat16())
        if chunked:
            lp, ent = token_outputs(logits, labels, entropy_grad=True)
        else:
            lp, ent = token_logprobs(logits, labels), token_entropy(logits)
        (lp.sum() + 0.01 * ent.sum()).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        outputs.append((lp.detach(), ent.detach(), x.grad, w.grad))
    for whole, chunk in zip(*outputs, strict=True):
        torch.testing.assert_close(chunk, whole, atol=1e-3, rtol=1e-3)
    assert peaks[1] < 0.6 * peaks[0], peaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_embedded_engine_on_cuda_answers_as_on_the_cpu(tmp_path: Path):
    from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model

    model = build_bpe_model(tmp_path / "model", TinyModelSpec(hidden=128, heads=2, kv_heads=2, intermediate=256))
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 12, "temperature": 0, "return_token_ids": True,
            "logprobs": 0}  # fmt: skip
    answers = []
    for device in ("cpu", "cuda"):
        config = EmbeddedEngineConfig(model_path=model, served_model_name="tiny", options=EmbeddedOptions(max_model_len=256, device=device))
        with EmbeddedEngine(config) as engine:
            answer = post_json(f"{engine.urls[0]}/v1/completions", body)
            answers.append(answer["choices"][0])
    cpu, cuda = answers
    assert cuda["token_ids"] == cpu["token_ids"] and len(cuda["token_ids"]) == 12
    for a, b in zip(cuda["logprobs"]["token_logprobs"], cpu["logprobs"]["token_logprobs"], strict=True):
        assert abs(a - b) < 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_embedded_engine_refuses_cuda_it_does_not_have(tmp_path: Path):
    from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model

    model = build_bpe_model(tmp_path / "model", TinyModelSpec(hidden=128, heads=2, kv_heads=2, intermediate=256))
    with pytest.raises(ValueError, match="engine.options.device: .cuda., but torch sees no CUDA device"):
        EmbeddedEngine(EmbeddedEngineConfig(model_path=model, options=EmbeddedOptions(device="cuda"))).start()


def test_the_gpu_rl_config_passes_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from agl_trainer.cli import main
    from examples.hops.model import build_hops_model

    model = build_hops_model(tmp_path / "model", seed=0)
    tasks, held_out = tmp_path / "tasks.jsonl", tmp_path / "val_tasks.jsonl"
    tasks.write_text('{"id": "a", "key": "k1", "hops": 1, "table": {"k1": "v1"}}\n')
    held_out.write_text('{"id": "b", "key": "k2", "hops": 1, "table": {"k2": "v2"}}\n')
    config = ROOT / "examples" / "hops" / "config-gpu.yaml"
    flags = [f"--model.path={model}", f"--tasks={tasks}", f"--val_tasks={held_out}", f"--output_dir={tmp_path / 'run'}"]
    assert main(["train", str(config), "--dry-run", *flags]) == 0
    out = capsys.readouterr().out
    assert "config OK (sync, 64 rollouts a step)" in out and "fits: peak" in out


def test_the_rl_summary_follows_its_definitions():
    rows = [
        {"step": 0, "val/reward": 0.1, "val/sampled/reward": 0.05},
        *({"step": s, "time/step_s": 1.0 + s, "time/generating_s": 0.5, "time/training_s": 0.25 * s,
           "time/syncing_s": 0.1, "perf/step_s": 0.2, "perf/tokens_per_s": 1000.0 + s, "reward/mean": s / 20}
          for s in range(1, 21)),
        {"step": 20, "val/reward": 0.6},
    ]  # fmt: skip
    summary = bench("gpu_rl_run").summarize(rows)
    assert summary["steps"] == 20
    assert summary["step_s_median"] == pytest.approx(11.5)  # median of 2..21
    assert summary["training_s_median"] == pytest.approx(0.25 * 10.5)
    assert summary["seconds"]["generating"] == pytest.approx(10.0)
    assert summary["reward_by_tenth"] == [pytest.approx((2 * t + 1.5) / 20) for t in range(10)]
    assert summary["val_greedy"] == [(0, 0.1), (20, 0.6)] and summary["val_sampled"] == [(0, 0.05)]
