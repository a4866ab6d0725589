"""`agl train CONFIG --dry-run`: the config validated, the memory per GPU printed, a verdict with the
fix; nothing started. The arithmetic is checked against numbers computed here from first principles."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from agl_trainer.cli import main

ROOT = Path(__file__).resolve().parents[2]
SWE = "examples/swe/config.yaml"
QWEN3_8B = 8_190_735_360  # Qwen3-8B's parameters (its safetensors index: 16,381,470,720 bf16 bytes)
GIB = 1024**3


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's paths are relative to the repository root; its harness runs `python` (the venv's)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["train", SWE, "--dry-run", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gib(text: str, label: str) -> float:
    match = re.search(rf"{label} ([0-9.]+) GiB", text)
    assert match, f"no {label!r} in:\n{text}"
    return float(match.group(1))


def test_swe_example_fits_on_8_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(capsys)
    assert code == 0, out
    assert "agl: config OK" in out and "8.19 B parameters from config.json" in out
    training = out.split("engine:")[0]
    # FSDP over 8 ranks, fp32 master weights: 4 bytes, gradients 4, AdamW 8 per parameter.
    assert gib(training, "weights") == pytest.approx(QWEN3_8B * 4 / 8 / GIB, abs=0.01)
    assert gib(training, "gradients") == pytest.approx(QWEN3_8B * 4 / 8 / GIB, abs=0.01)
    assert gib(training, "AdamW") == pytest.approx(QWEN3_8B * 8 / 8 / GIB, abs=0.01)
    engine = out.split("engine:")[1]
    assert gib(engine, "weights") == pytest.approx(QWEN3_8B * 2 / GIB, abs=0.01)  # bf16, TP 1
    kv_per_token = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, bf16
    kv = gib(engine, "KV cache")
    tokens = int(re.search(r"= ([0-9,]+) tokens", engine).group(1).replace(",", ""))
    assert tokens == pytest.approx(kv * GIB / kv_per_token, rel=1e-3)
    assert "144 KiB/token" in engine
    assert "holds no weights" in out  # model.path is the architecture only
    assert re.search(r"fits: peak [0-9.]+ GiB of 80 GiB", out)


def test_one_gpu_without_offload_does_not_fit_and_the_suggested_layout_does(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--backend.verl.n_gpus_per_node=1", "--engine.replicas=1",
             "--backend.verl.param_offload=false", "--backend.verl.optimizer_offload=false"]  # fmt: skip
    code, out, _ = dry_run(capsys, *small)
    assert code == 1
    assert "does not fit on 80 GiB GPUs" in out
    assert "while generating" in out and "while training" in out
    assert "fix: set backend.verl.param_offload: true and backend.verl.optimizer_offload: true" in out
    layout = re.search(r"backend.verl.nnodes: (\d+), backend.verl.n_gpus_per_node: (\d+)", out)
    assert layout, out
    nodes, per_node = layout.groups()
    suggested = [*small, f"--backend.verl.nnodes={nodes}", f"--backend.verl.n_gpus_per_node={per_node}"]
    assert dry_run(capsys, *suggested)[0] == 0
    fewer = [*small, f"--backend.verl.nnodes={nodes}", f"--backend.verl.n_gpus_per_node={int(per_node) - 1}"]
    assert dry_run(capsys, *fewer)[0] == 1  # the suggestion is the smallest that fits


def test_offload_moves_the_trainer_state_out_of_the_generating_phase(capsys: pytest.CaptureFixture[str]) -> None:
    _, offloaded, _ = dry_run(capsys)
    _, resident, _ = dry_run(capsys, "--backend.verl.param_offload=false", "--backend.verl.optimizer_offload=false")
    state = QWEN3_8B * 16 / 8 / GIB  # params + grads + AdamW, sharded over 8
    assert gib(resident, "generating") - gib(offloaded, "generating") == pytest.approx(state, abs=0.02)
    assert gib(resident, "training") == pytest.approx(gib(offloaded, "training"), abs=0.01)


@pytest.mark.parametrize(
    "flag", ["--backend.options.param_dtype=bfloat16", "--backend.verl.override={fsdp_config.model_dtype: bf16}"]
)
def test_bf16_master_weights_halve_the_trainer_state(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    code, out, err = dry_run(capsys, flag)
    assert code == 0, err
    assert "master weights 16-bit" in out
    assert gib(out.split("engine:")[0], "weights") == pytest.approx(QWEN3_8B * 2 / 8 / GIB, abs=0.01)


def test_a_keep_switch_keeps_vllm_awake_while_training(capsys: pytest.CaptureFixture[str]) -> None:
    """loop.switch: keep skips the collocated sleep (it would drop the frozen calls' KV cache): the
    engine's whole budget (gpu_memory_utilization 0.6 of the GPU) stays there while the trainer
    trains, and where that does not fit the fix says so."""
    for gpu in (80, 40):
        drain_code, drain, _ = dry_run(capsys, f"--gpu-memory-gib={gpu}")
        code, keep, _ = dry_run(capsys, "--loop.switch=keep", f"--gpu-memory-gib={gpu}")
        assert "sleeps while training" in drain and "frozen calls keep their KV cache" in keep
        assert gib(keep, "training") == pytest.approx(gib(drain, "training") + 0.6 * gpu, abs=0.02)
        assert drain_code == 0
        assert code == (0 if gpu == 80 else 1), keep
    assert "fix: set loop.switch: drain" in keep


def test_kv_cache_too_small_for_one_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(capsys, "--engine.options.gpu_memory_utilization=0.25", "--engine.options.max_model_len=40960")
    assert code == 1
    assert "one sequence of max_model_len 40960 needs 5.62 GiB (vLLM refuses to start)" in out
    assert "raise engine.options.gpu_memory_utilization" in out


def test_gpu_memory_size_flag(capsys: pytest.CaptureFixture[str]) -> None:
    squeeze = ["--engine.options.gpu_memory_utilization=0.9", "--backend.verl.param_offload=false"]
    assert dry_run(capsys, *squeeze)[0] == 1
    code, out, _ = dry_run(capsys, *squeeze, "--gpu-memory-gib", "141")
    assert code == 0 and "of 141 GiB per GPU" in out
    assert dry_run(capsys, *squeeze, "--gpu-memory-gib=141")[0] == 0


def test_bad_input_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = dry_run(capsys, "--gpu-memory-gib", "-3")
    assert code == 2 and "--gpu-memory-gib needs a positive number of GiB, got '-3'" in err
    code, _, err = dry_run(capsys, f"--model.path={tmp_path}")
    assert code == 2 and "config key model.path:" in err and "config.json does not exist" in err
    code, _, err = dry_run(capsys, "--backend.verl.nnodes=0")
    assert code == 2 and "config key backend.verl.nnodes" in err


def test_check_still_only_validates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", SWE, "--check"]) == 0
    out = capsys.readouterr().out
    assert "agl: config OK" in out and "per GPU" not in out


def test_torch_backend_with_the_embedded_engine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from examples.demo.model import build_demo_model
    from agl_trainer.resources import safetensors_parameters

    model = build_demo_model(tmp_path / "tiny")
    code = main(["train", SWE, "--dry-run", f"--model.path={model}", "--backend.name=torch", "--engine.name=embedded", "--engine.options={}"])
    out = capsys.readouterr().out
    assert code == 0, out
    params = safetensors_parameters(model)
    assert f"{params / 1e6:.2f} M parameters from safetensors" in out
    assert "torch backend, one device" in out and "engine: embedded" in out and "holds no weights" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend.device=cpu"], "config key backend.verl.param_offload: True needs CUDA GPUs"),
        (["--loop.batch_rollouts=4", "--loop.group_size=4"], "data-parallel size 8"),
        (["--engine.options.gpu_memory_util=0.5"],
         "config key engine.options.gpu_memory_util: not a setting of engine vllm (fix: did you mean "
         "engine.options.gpu_memory_utilization?)"),
        (["--backend.options.micro_batch_tokenz=1"], "config key backend.options:"),
        (["--backend.verl.weight_sync=cuda_ipc"], "config key backend.verl.weight_sync: engine.options.weight_sync: cuda_ipc"),
    ],
)
def test_backend_and_engine_settings_are_checked_before_the_arithmetic(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = dry_run(capsys, *args)
    assert code == 2 and message in err
    assert "config OK" not in out and "per GPU" not in out
