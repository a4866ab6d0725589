"""`agl train --dry-run` with LoRA (backend.lora.rank > 0): trainable parameters from the architecture,
gradients and AdamW for the adapters only, the frozen base once, vLLM's own copy of the base, and the
one-GPU SWE config (examples/swe/config-lora-1gpu.yaml) fitting on 80 GiB. Expected numbers are
computed here from examples/swe/model-config/config.json and the YAML, not read from the plan."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from agl_trainer.cli import main
from agl_trainer.config import load_config
from agl_trainer.resources import format_plan, plan_resources

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "examples/swe/config-lora-1gpu.yaml"
QWEN3_8B = 8_190_735_360  # Qwen3-8B's parameters (its safetensors index: 16,381,470,720 bf16 bytes)
GIB = 1024**3
MLP_AND_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


ARCH = json.loads((ROOT / "examples/swe/model-config/config.json").read_text())
YAML = yaml.safe_load((ROOT / CONFIG).read_text())
H, INTER, LAYERS = ARCH["hidden_size"], ARCH["intermediate_size"], ARCH["num_hidden_layers"]
Q, KV = ARCH["num_attention_heads"] * ARCH["head_dim"], ARCH["num_key_value_heads"] * ARCH["head_dim"]
IN_OUT = {"q_proj": H + Q, "k_proj": H + KV, "v_proj": H + KV, "o_proj": Q + H,
          "gate_proj": H + INTER, "up_proj": H + INTER, "down_proj": INTER + H}  # fmt: skip
WEIGHT = {"q_proj": H * Q, "k_proj": H * KV, "v_proj": H * KV, "o_proj": Q * H,
          "gate_proj": H * INTER, "up_proj": H * INTER, "down_proj": INTER * H}  # fmt: skip


def adapter_parameters(rank: int, modules: tuple[str, ...] = MLP_AND_ATTENTION) -> int:
    return rank * LAYERS * sum(IN_OUT[name] for name in modules)


def vllm_lora_buffers(rank: int) -> int:
    """vLLM's LoRA buffers (bf16, --max-loras 1): every linear layer's A and B and the output head's,
    which vLLM wraps whatever the adapter targets."""
    return 2 * (adapter_parameters(rank) + rank * (H + ARCH["vocab_size"]))


def activations(tokens: int) -> float:
    """The plan's estimate, gradient checkpointing on: bf16 layer inputs + one layer, fp32 logits + grad."""
    per_token = 2 * (LAYERS * H + 6 * H + 4 * INTER) + 8 * ARCH["vocab_size"]
    return tokens * per_token


def dry_run(capsys: pytest.CaptureFixture[str], *args: str, config: str = CONFIG) -> tuple[int, str, str]:
    code = main(["train", config, "--dry-run", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def gib(text: str, label: str) -> float:
    match = re.search(rf"{label} ~?([0-9.]+) GiB", text)
    assert match, f"no {label!r} in:\n{text}"
    return float(match.group(1))


def test_swe_one_gpu_lora_config_fits_on_80_gib(capsys: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.resources.settings import engine_takes_adapters

    code, out, err = dry_run(capsys)
    assert code == 0, out + err
    lora, options = YAML["backend"]["lora"], YAML["engine"]["options"]
    rank, utilization, max_len = lora["rank"], options["gpu_memory_utilization"], options["max_model_len"]
    assert YAML["engine"]["replicas"] == 1 and options["collocated"] and YAML["backend"]["name"] == "torch"
    trainable = adapter_parameters(rank)
    assert f"{trainable / 1e6:.2f} M trainable parameters" in out
    assert f"{LAYERS * len(MLP_AND_ATTENTION)} linear layers" in out
    training, engine = out.split("\nengine:")
    base = QWEN3_8B * 2  # bf16 (backend.options.param_dtype), once
    adapter = trainable * 4  # float32, as peft keeps adapters
    assert gib(training, "frozen base") == pytest.approx(base / GIB, abs=0.01)
    assert gib(training, "adapters") == pytest.approx(adapter / GIB, abs=0.01)
    assert gib(training, "gradients") == pytest.approx(adapter / GIB, abs=0.01)  # the adapters' only
    assert gib(training, "AdamW") == pytest.approx(2 * adapter / GIB, abs=0.01)
    acts = activations(max(YAML["backend"]["options"]["micro_batch_tokens"], max_len))
    assert gib(training, "activations") == pytest.approx(acts / GIB, abs=0.01)

    takes = engine_takes_adapters(load_config(CONFIG, [], check_paths=False))
    slots = vllm_lora_buffers(rank) if takes else 0
    merging = 0 if takes else 3 * 4 * max(WEIGHT.values())  # one weight at a time (lora.adapter_deltas)
    assert ("sync: the adapter alone" in training) == takes
    assert gib(engine, "weights") == pytest.approx(QWEN3_8B * 2 / GIB, abs=0.01)  # vLLM's own copy
    assert "loads its own copy, not shared" in engine and "one while training" in engine
    budget = utilization * 80 * GIB
    kv = budget - QWEN3_8B * 2 - slots - 1.5 * GIB
    assert gib(engine, "KV cache") == pytest.approx(kv / GIB, abs=0.01)
    tokens = int(re.search(r"= ([0-9,]+) tokens", engine).group(1).replace(",", ""))
    assert tokens == int(kv // (2 * LAYERS * KV * 2))
    assert tokens >= max_len  # at least one full-length call

    context = 2 * GIB  # trainer + vLLM processes
    state = base + 4 * adapter  # adapters + gradients + AdamW's two moments
    training_total = state + acts + context
    assert gib(out, "training") == pytest.approx(training_total / GIB, abs=0.01)  # vLLM asleep
    # the trainer hands its cached blocks back before vLLM wakes: its state stays, not its peak
    generating = state + budget + context
    assert gib(out, "generating") == pytest.approx(generating / GIB, abs=0.01)
    assert utilization > 0.4  # more than the trainer's retained peak left vLLM
    peak = max(generating, training_total, state + merging + context)
    assert peak <= 80 * GIB
    assert f"fits: peak {peak / GIB:.2f} GiB of 80 GiB" in out


def test_the_merging_sync_is_counted_where_the_engine_takes_no_adapter() -> None:
    config = load_config(CONFIG, [], check_paths=False)
    merged, alone = (plan_resources(config, 80, takes_adapters=takes) for takes in (False, True))
    # one weight at a time (lora.adapter_deltas): the largest's float32 update, base copy and sum
    assert merged.trainer.sync_bytes == 3 * 4 * max(WEIGHT.values())
    assert alone.trainer.sync_bytes == 0 and alone.syncing_bytes == 0
    assert merged.syncing_bytes == merged.trainer.sync_peak_bytes + 2 * GIB  # vLLM asleep meanwhile
    assert merged.engine.adapter_bytes == 0 and alone.engine.adapter_bytes == vllm_lora_buffers(32)
    text = format_plan(merged)
    assert "the merged weights" in text and f"merging {merged.syncing_bytes / GIB:.2f} GiB" in text


def test_trainable_parameters_follow_target_modules(capsys: pytest.CaptureFixture[str]) -> None:
    rank = YAML["backend"]["lora"]["rank"]
    _, attention_only, _ = dry_run(capsys, "--backend.lora.target_modules=q_proj,v_proj")
    assert f"{adapter_parameters(rank, ('q_proj', 'v_proj')) / 1e6:.2f} M trainable" in attention_only
    assert f"{2 * LAYERS} linear layers" in attention_only and "on q_proj, v_proj:" in attention_only
    _, every, _ = dry_run(capsys, "--backend.lora.target_modules=all-linear")
    _, listed, _ = dry_run(capsys, f"--backend.lora.target_modules={','.join(MLP_AND_ATTENTION)}")
    assert f"{adapter_parameters(rank) / 1e6:.2f} M trainable" in every  # all-linear: not the output head
    assert every == listed
    _, doubled, _ = dry_run(capsys, f"--backend.lora.rank={2 * rank}")
    assert f"{adapter_parameters(2 * rank) / 1e6:.2f} M trainable" in doubled


def test_an_unknown_target_is_refused_as_the_backend_would(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = dry_run(capsys, "--backend.lora.target_modules=q_proj,qkv_proj")
    assert code == 2 and "config key backend.lora.target_modules: qkv_proj match no linear layer" in err
    assert "gate_proj" in err and "per GPU" not in out


def test_what_does_not_fit_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(
        capsys, "--engine.options.max_model_len=32768", "--backend.options.param_dtype=float32"
    )
    assert code == 1 and "does not fit on 80 GiB GPUs" in out
    assert gib(out.split("\nengine:")[0], "frozen base") == pytest.approx(QWEN3_8B * 4 / GIB, abs=0.01)
    assert "while training" in out and "while generating" in out
    assert "fix: set backend.options.param_dtype: bfloat16" in out
    assert "fix: lower engine.options.max_model_len (now 32768" in out
    code, out, _ = dry_run(capsys, "--backend.lora.rank=0")  # full training: every weight, AdamW on all
    assert code == 1 and "LoRA" not in out and "fix: use backend.name: verl" in out


def test_full_training_counts_a_kl_reference_and_lora_does_not(capsys: pytest.CaptureFixture[str]) -> None:
    _, full, _ = dry_run(capsys, "--backend.lora.rank=0", "--backend.algorithm={kl_coef: 0.01}")
    assert gib(full, "KL reference model") == pytest.approx(QWEN3_8B * 2 / GIB, abs=0.01)
    _, lora, _ = dry_run(capsys, "--backend.algorithm={kl_coef: 0.01}")
    _, plain, _ = dry_run(capsys)
    assert "KL reference model" not in lora and gib(lora, "training") == gib(plain, "training")


def test_embedded_engine_keeps_copies_of_the_adapted_weights(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from examples.demo.model import build_demo_model
    from agl_trainer.resources import architecture_from_dict

    model = build_demo_model(tmp_path / "tiny")
    code, out, err = dry_run(
        capsys, f"--model.path={model}", "--engine.name=embedded", "--engine.options={}", "--backend.device=cpu",
        "--backend.lora.rank=4", "--backend.lora.target_modules=q_proj,v_proj",
    )  # fmt: skip
    assert code == 0, err
    arch = architecture_from_dict(json.loads((model / "config.json").read_text()))
    heads = arch.num_attention_heads + arch.num_key_value_heads  # q_proj's and v_proj's outputs
    copies = 4 * arch.num_hidden_layers * arch.hidden_size * heads * arch.head_dim  # float32, the pristine q and v weights the adapters merge into
    assert "copies of the adapted weights" in out  # a tiny model: 0.00 GiB printed; the bytes below
    assert "sync: the adapter alone" in out and "loads its own copy" not in out
    overrides = [f"--model.path={model}", "--engine.name=embedded", "--engine.options={}", "--backend.lora.rank=4",
                 "--backend.lora.target_modules=q_proj,v_proj"]  # fmt: skip
    plan = plan_resources(load_config(CONFIG, overrides, check_paths=False))
    assert plan.engine.adapter_bytes == copies
    assert plan.engine.budget_bytes == plan.engine.weights_bytes + copies


def test_an_adapter_on_a_tied_output_head_is_counted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """lm_head adapted on the (tied) demo model, as the backend allows it: its adapter trains rank x
    (hidden + vocab) more; the embedded engine holds the head's pristine copy and its own untied head."""
    from agl_trainer.resources import architecture_from_dict

    from examples.demo.model import build_demo_model

    model = build_demo_model(tmp_path / "tiny")
    arch = architecture_from_dict(json.loads((model / "config.json").read_text()))
    assert arch.tie_word_embeddings
    base = [f"--model.path={model}", "--engine.name=embedded", "--engine.options={}", "--backend.lora.rank=4"]
    only_q, both = ["--backend.lora.target_modules=q_proj"], ["--backend.lora.target_modules=q_proj,lm_head"]
    plain = plan_resources(load_config(CONFIG, [*base, *only_q], check_paths=False))
    headed = plan_resources(load_config(CONFIG, [*base, *both], check_paths=False))
    head = arch.hidden_size * arch.vocab_size
    assert plain.trainer.lora is not None and headed.trainer.lora is not None
    added = headed.trainer.lora.parameters - plain.trainer.lora.parameters
    assert added == 4 * (arch.hidden_size + arch.vocab_size)  # rank x (in + out)
    assert headed.trainer.lora.modules == ("q_proj", "lm_head") and headed.trainer.lora.untied_head == head
    assert headed.engine.adapter_bytes - plain.engine.adapter_bytes == 4 * 2 * head  # pristine + untied copy
    code, out, err = dry_run(capsys, *base, "--backend.device=cpu", *both)
    assert code == 0 and "on q_proj, lm_head:" in out, out + err
