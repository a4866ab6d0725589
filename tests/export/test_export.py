"""`agl export`: a LoRA checkpoint of the torch backend (tiny random Qwen2, CPU) as a merged model that
transformers loads with the same logits as base + adapter through peft, and as the bare peft adapter;
a full-training checkpoint as its model; every user error a message, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from agl_trainer.backends import TorchBackend
from agl_trainer.cli import main
from agl_trainer.loop.checkpoint import Checkpoints, LoopState
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.algorithms.test_lora import logits, trained
from tests.algorithms.tiny import make_tiny_model, random_batch, training_config

ATOL = 1e-5  # as tests/algorithms/test_lora.py: base + adapter vs merged weights, float32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def save_run(backend: TorchBackend, run: Path, steps: int = 2) -> Path:
    """A run's output_dir as the loop leaves it: checkpoints/step_N/{backend/, loop.json} + latest."""
    return Checkpoints(run / "checkpoints").save(LoopState(step=steps, policy_version=steps), backend)


@pytest.fixture(scope="module")
def lora_run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    backend = trained(model_dir, steps=2)
    run = tmp_path_factory.mktemp("lora-run")
    save_run(backend, run)
    return run, logits(backend.model)  # base + adapter, through peft


def export(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main(["export", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


# ------------------------------------------------------------------------------------------- LoRA
def test_merged_model_equals_base_plus_adapter(
    capsys: pytest.CaptureFixture[str], model_dir: Path, lora_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    from peft import PeftModel

    run, peft_logits = lora_run
    code, out, err = export(capsys, run, "--out", tmp_path / "out")
    assert code == 0, err
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(logits(merged), peft_logits, atol=ATOL, rtol=ATOL)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.allclose(logits(base), peft_logits, atol=1e-3)  # the adapter does something
    adapted = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter")  # peft loads the bare adapter
    torch.testing.assert_close(logits(adapted), peft_logits, atol=ATOL, rtol=ATOL)
    assert set(weights(tmp_path / "out")) == set(weights(model_dir))  # the base's names, nothing of peft's
    assert AutoTokenizer.from_pretrained(tmp_path / "out").convert_tokens_to_ids("w5") == 5
    assert "merged model (base + adapter)" in out and "peft format" in out and "rank 4" in out


def test_an_adapted_tied_head_is_exported_untied(
    capsys: pytest.CaptureFixture[str], model_dir: Path, tmp_path: Path
) -> None:
    """lm_head adapted on the tied model: the merged model holds the head as a weight of its own (the
    embedding unchanged) and its config unties it, so transformers loads exactly the policy."""
    targets = ("q_proj", "v_proj", "lm_head")
    backend = trained(model_dir, steps=2, lora={"target_modules": targets})
    save_run(backend, tmp_path / "run")
    code, _, err = export(capsys, tmp_path / "run", "--out", tmp_path / "out", "--merged")
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    got, base = weights(tmp_path / "out"), weights(model_dir)
    assert set(got) == set(base) | {"lm_head.weight"}
    assert torch.equal(got["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert merged.lm_head.weight is not merged.model.embed_tokens.weight
    torch.testing.assert_close(logits(merged), logits(backend.model), atol=ATOL, rtol=ATOL)
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.allclose(logits(original), logits(merged), atol=1e-3)


def test_adapter_only_and_merged_only(
    capsys: pytest.CaptureFixture[str], lora_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run, _ = lora_run
    step = Checkpoints(run / "checkpoints").latest()
    assert step is not None
    for source in (step, step / "backend", run / "checkpoints"):  # every way of naming the checkpoint
        out = tmp_path / f"adapter-{source.name}"
        assert export(capsys, source, "--out", out, "--adapter")[0] == 0
        assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
        assert not (out / "config.json").exists()
        saved = load_file(step / "backend" / "adapter" / "adapter_model.safetensors")
        exported = load_file(out / "adapter_model.safetensors")
        assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)
    assert export(capsys, run, "--out", tmp_path / "merged", "--merged")[0] == 0
    assert (tmp_path / "merged" / "config.json").is_file() and not (tmp_path / "merged" / "adapter").exists()


def test_dtype_rounds_the_float32_merge_once(
    capsys: pytest.CaptureFixture[str], lora_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run, _ = lora_run
    assert export(capsys, run, "--out", tmp_path / "f32", "--merged")[0] == 0
    assert export(capsys, run, "--out", tmp_path / "bf16", "--merged", "--dtype", "bfloat16")[0] == 0
    full, half = weights(tmp_path / "f32"), weights(tmp_path / "bf16")
    assert half.keys() == full.keys()
    assert all(half[n].dtype == torch.bfloat16 and torch.equal(half[n], full[n].bfloat16()) for n in full)
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "bfloat16" in {config.get("torch_dtype"), config.get("dtype")}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_a_moved_base_is_named_with_base(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    backend = trained(model, steps=1)
    want = logits(backend.model)
    save_run(backend, tmp_path / "run", steps=1)
    moved = tmp_path / "moved"
    model.rename(moved)
    code, _, err = export(capsys, tmp_path / "run", "--out", tmp_path / "out")
    assert code == 2 and f"({model}) is not there" in err and "fix: --base MODEL_DIR" in err
    assert not (tmp_path / "out").exists()
    assert export(capsys, tmp_path / "run", "--out", tmp_path / "out", "--base", moved)[0] == 0
    got = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out"))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


# ------------------------------------------------------------------------------------------ full
def test_full_checkpoint_exports_the_model_as_trained(
    capsys: pytest.CaptureFixture[str], model_dir: Path, tmp_path: Path
) -> None:
    backend = TorchBackend(training_config(model_dir))
    backend.train_step(random_batch(2, 2, seed=0), 0)
    save_run(backend, tmp_path / "run", steps=1)
    code, out, err = export(capsys, tmp_path / "run", "--out", tmp_path / "out")
    assert code == 0, err
    assert "full weights" in out and "adapter" not in out
    got = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out"))
    torch.testing.assert_close(got, logits(backend.model), atol=0, rtol=0)
    assert not torch.allclose(got, logits(AutoModelForCausalLM.from_pretrained(model_dir)), atol=1e-4)
    code, _, err = export(capsys, tmp_path / "run", "--out", tmp_path / "adapter", "--adapter")
    assert code == 2 and "is a full-training checkpoint" in err and "leave out --adapter" in err


# ---------------------------------------------------------------------------------------- errors
def test_user_errors_are_messages(
    capsys: pytest.CaptureFixture[str], lora_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run, _ = lora_run
    cases = {
        "missing": (tmp_path / "nope", "does not exist"),
        "not a checkpoint": (tmp_path / "plain", "is not a checkpoint: no adapter/ or model/"),
        "no checkpoint yet": (tmp_path / "young-run", "holds a run but no complete checkpoint"),
        "verl": (tmp_path / "verl-ckpt", "python -m verl.model_merger merge --backend fsdp"),
    }
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    (tmp_path / "young-run").mkdir()
    (tmp_path / "young-run" / "run.json").write_text("{}")
    (tmp_path / "verl-ckpt" / "backend" / "verl").mkdir(parents=True)
    for name, (source, message) in cases.items():
        code, _, err = export(capsys, source, "--out", tmp_path / "out")
        assert code == 2 and err.startswith("agl: error: ") and message in err, name
        assert "Traceback" not in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, _, err = export(capsys, run, "--out", busy)
    assert code == 2 and "exists and is not empty" in err and "--force" in err
    assert (busy / "keep.txt").read_text() == "mine"
    assert export(capsys, run, "--out", busy, "--force")[0] == 0
    assert not (busy / "keep.txt").exists() and (busy / "config.json").is_file()
    for around in (run, run / "checkpoints", Checkpoints(run / "checkpoints").latest()):
        code, _, err = export(capsys, run, "--out", around, "--force")  # would replace what it reads
        assert code == 2 and "inside or around the checkpoint" in err
    assert Checkpoints(run / "checkpoints").latest() is not None
    code, _, err = export(capsys, run, "--out", tmp_path / "x", "--base", tmp_path / "plain")
    assert code == 2 and "--base" in err and "no config.json" in err
    with pytest.raises(SystemExit) as exit_:
        export(capsys, run)  # --out is required: argparse's usage message
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err
