"""scripts/gpu_check.sh and bench/gpu_step.py, the parts that run without a GPU: the step
measurement on a tiny model on the CPU (numbers checked against their definitions), the script's
refusals on a machine without CUDA, and the `gpu` selection it runs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_step() -> ModuleType:
    """bench/gpu_step.py as a module (bench/ is not a package)."""
    if "gpu_step" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "bench" / "gpu_step.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_step"] = module  # its dataclass looks itself up there
        spec.loader.exec_module(module)
    return sys.modules["gpu_step"]


def run_tiny(tmp_path: Path, backend: str) -> list[dict]:
    out = tmp_path / "step.json"
    args = ["--device", "cpu", "--tiny", "--backend", backend, "--steps", "1", "--tasks", "2", "--per-task", "2",
            "--max-len", "128", "--peak-tflops", "100", "--json", str(out)]  # fmt: skip
    assert gpu_step().main(args) == 0
    return json.loads(out.read_text())


def test_tiny_cpu_step_numbers_follow_their_definitions(tmp_path: Path) -> None:
    (result,) = run_tiny(tmp_path, "torch")
    module = gpu_step()
    from transformers import AutoModelForCausalLM, Qwen2Config

    independent = sum(p.numel() for p in AutoModelForCausalLM.from_config(Qwen2Config(**module.TINY)).parameters())
    assert result["parameters"] == independent
    batch = sys.modules["train_step"].ragged_batch(2, 2, module.TINY["vocab_size"], 128, seed=0)
    assert result["tokens"] == int(batch.attention_mask.sum())
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["step_s"])
    assert result["mfu_6nd"] == pytest.approx(6 * independent * result["tokens"] / result["step_s"] / 100e12)
    # model FLOPs: the layers' matrices per token, causal attention per sample, the head at scored positions
    arch = module.TINY
    h, layers, vocab = arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"]
    kv = arch["num_key_value_heads"] * h // arch["num_attention_heads"]
    matrices = layers * (h * h + 2 * h * kv + h * h + 3 * h * arch["intermediate_size"])
    lengths = batch.attention_mask.sum(-1).double()
    flops = (
        6 * matrices * result["tokens"]
        + 6 * h * layers * float((lengths * (lengths + 1)).sum())
        + 6 * h * vocab * float(batch.loss_mask[:, 1:].sum())
    )
    assert result["model_flops"] == pytest.approx(flops)
    assert result["mfu"] == pytest.approx(flops / result["step_s"] / 100e12)
    assert result["step_s"] > 0 and abs(result["loss"]) < 10
    assert result["micro_batches"] >= 1 and result["export_s"] > 0


@pytest.mark.slow
def test_tiny_cpu_step_with_both_backends_same_loss(tmp_path: Path) -> None:
    torch_result, verl_result = run_tiny(tmp_path, "both")
    assert (torch_result["backend"], verl_result["backend"]) == ("torch", "verl")
    assert verl_result["tokens"] == torch_result["tokens"]
    assert verl_result["loss"] == pytest.approx(torch_result["loss"], abs=1e-5)  # same batch, same weights
    assert verl_result["export_s"] > 0
    # one verl worker runs the torch backend's micro-batches (backends/packing.py pack_samples)
    assert verl_result["micro_batches"] == torch_result["micro_batches"] >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_step_without_cuda_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_step().main(["--device", "cuda", "--tiny"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def run_script(path_dirs: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PATH": os.pathsep.join(path_dirs + [os.environ["PATH"]])}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_script_refuses_a_machine_without_a_gpu(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    no_smi = subprocess.run(["bash", "-c", "command -v nvidia-smi"], capture_output=True, check=False).returncode != 0
    if no_smi:
        result = run_script([str(empty)])
        assert result.returncode == 2 and "no NVIDIA GPU here" in result.stderr
    # A driver tool that answers, but a torch without CUDA: the second guard names torch.
    smi = empty / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB'\n")
    smi.chmod(0o755)
    result = run_script([str(empty)])
    assert result.returncode == 2 and "torch does not see CUDA" in result.stderr


def test_script_syntax() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


@pytest.mark.slow  # collects the whole test tree
def test_gpu_selection_finds_the_gpu_tests() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout[-2000:]
    ids = listed.stdout
    assert "tests/algorithms/test_torch_backend.py::test_bf16_step_on_cuda" in ids
    assert "tests/vllm/test_vllm_gpu.py::test_collocated_sleep_wake_and_sync_on_gpu" in ids
    assert "tests/vllm/test_vllm_weight_transfer_gpu.py::test_gpu_weight_transfer_updates_the_served_model[nccl]" in ids


def standin_machine(tmp_path: Path, python_body: str = "") -> tuple[dict[str, str], Path]:
    """A PATH with a driver tool that answers and a stand-in interpreter that records its arguments
    (and runs `python_body` first, e.g. to fail the RL run's import check)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB'\n")
    log = tmp_path / "calls"
    python = bin_dir / "python-standin"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{python_body}\n')
    for tool in (smi, python):
        tool.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "AGL_VLLM_PYTHON": str(python), "GPU_CHECK_OUT": str(tmp_path / "out"),
           "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]])}  # fmt: skip
    return env, log


def run_standin(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_every_part_runs_with_its_size_and_the_limits_fit_a_device_command(tmp_path: Path) -> None:
    """GPU_CHECK_TEST_PATHS reaches pytest word by word; each part gets its GPU size; the summary
    names every part with its estimate and limit, and the limits together fit a device's 600 s."""
    env, log = standin_machine(tmp_path)
    env["GPU_CHECK_TEST_PATHS"] = "tests/a.py tests/b dir/c.py"
    result = run_standin(env)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    (pytest_call,) = [c for c in calls if c.startswith("-m pytest")]
    assert " -m gpu " in pytest_call and "--collect-only" not in pytest_call
    assert pytest_call.endswith("tests/a.py tests/b dir/c.py")
    steps = [c for c in calls if c.startswith("bench/gpu_step.py")]
    assert len(steps) == 2 and all("--device cuda --model 0.5b" in c and "--backend both" in c for c in steps)
    assert "--attn agl_varlen" in steps[1] and "--attn" not in steps[0]
    assert any(c.startswith("bench/chunked_logprobs.py --device cuda --dtype bfloat16") for c in calls)
    assert any(c.startswith("bench/gpu_rl_run.py --device cuda --budget-s 60") for c in calls)
    assert not any("flex_attention" in c for c in calls)  # opt-in (GPU_CHECK_FLEX=1)
    limits = [int(m) for m in re.findall(r"limit (\d+)\)", result.stdout)]
    estimates = [int(m) for m in re.findall(r"\(estimate (\d+), limit", result.stdout)]
    assert len(limits) == len(estimates) == 5
    assert sum(limits) <= 600 and sum(estimates) <= 7 * 60
    assert "gpu_check: all parts passed" in result.stdout


def test_dry_mode_runs_every_part_on_the_cpu_without_a_gpu(tmp_path: Path) -> None:
    env, log = standin_machine(tmp_path)
    (tmp_path / "bin" / "nvidia-smi").unlink()  # no driver: the dry mode does not ask for one
    env["GPU_CHECK_FLEX"] = "1"
    result = run_standin(env, "--cpu-smoke")
    calls = log.read_text().splitlines()
    assert any(c.startswith("-m pytest -m gpu --collect-only") for c in calls)
    steps = [c for c in calls if c.startswith("bench/gpu_step.py")]
    assert len(steps) == 2 and all("--device cpu --model tiny" in c for c in steps)
    assert any(c.startswith("bench/chunked_logprobs.py --positions 256") for c in calls)
    assert any(c.startswith("bench/gpu_rl_run.py --device cpu") for c in calls)
    # flex_attention has no backward on the CPU: named as not run, which fails the check
    assert "flex_attention: not run: flex_attention has no backward on the CPU" in result.stdout
    assert result.returncode == 1


def test_the_rl_run_says_which_packages_are_missing(tmp_path: Path) -> None:
    fail_imports = 'case "$*" in *find_spec*) echo "openai, tensorboard"; exit 1;; esac'
    env, log = standin_machine(tmp_path, fail_imports)
    env["GPU_CHECK_PARTS"] = "rl"
    result = run_standin(env)
    assert result.returncode == 1
    assert "whole RL run: not run: " in result.stdout and "cannot import openai, tensorboard" in result.stdout
    assert "scripts/gpu_site.sh" in result.stdout
    assert not any(c.startswith("bench/gpu_rl_run.py") for c in log.read_text().splitlines())
