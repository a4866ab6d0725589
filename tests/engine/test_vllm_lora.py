"""The vLLM engine's LoRA side without vLLM: the server flags, the adapter files every replica reads,
the run settings that turn it on. The calls on the wire: tests/vllm/test_vllm_lora_control.py; real
vLLM: tests/vllm/test_vllm_lora.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from agl_trainer.backends import lora
from agl_trainer.backends.torch_config import LoraConfig
from agl_trainer.config import ConfigError, validate
from agl_trainer.engines.vllm.config import VLLMConfig, VLLMOptions
from agl_trainer.engines.vllm.engine import VLLMEngine
from agl_trainer.engines.vllm.lora import AdapterFiles, base_model_name, max_lora_rank
from agl_trainer.run.settings import vllm_options
from agl_trainer.weights.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS


@pytest.fixture
def peft_model(bpe_model_dir: Path):  # type: ignore[no-untyped-def]
    """The fixtures' tiny model with a rank-4 adapter whose B is not zero (a trained one)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(bpe_model_dir, dtype=torch.float32).eval()
    model = lora.wrap(base, LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return model.eval()


# --- flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rank", "flag"), [(1, 1), (4, 8), (8, 8), (9, 16), (64, 64), (100, 128), (512, 512)]
)
def test_max_lora_rank_is_the_smallest_choice_vllm_accepts(rank: int, flag: int) -> None:
    assert max_lora_rank(rank) == flag


def test_a_lora_engine_serves_the_base_internally_and_the_adapter_under_the_model_name(tmp_path: Path) -> None:
    options = VLLMOptions(served_model_name="tiny", lora_rank=4, weights_dir=str(tmp_path), python=sys.executable,
                          device="cpu")  # fmt: skip
    config = VLLMConfig(model="m", options=options)
    engine = VLLMEngine(config)
    assert engine.accepts_adapters and not VLLMEngine.accepts_adapters  # the instance, not every engine
    cmd = engine.command(8000)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert flag("--served-model-name") == "tiny-base" == base_model_name("tiny")
    assert cmd.count("--served-model-name") == 1 and "--enable-lora" in cmd
    assert flag("--max-lora-rank") == "8" and flag("--max-loras") == "1"
    module = json.loads(flag("--lora-modules"))  # JSON: a path with "=" would break vLLM's name=path form
    current = str(tmp_path / "lora" / "current")
    assert module == {"name": "tiny", "path": current, "base_model_name": "tiny-base"}


def test_an_engine_without_lora_keeps_its_flags_and_takes_no_adapter(tmp_path: Path) -> None:
    options = VLLMOptions(served_model_name="tiny", python=sys.executable, device="cpu")
    engine = VLLMEngine(VLLMConfig(model="m", options=options))
    cmd = engine.command(8000)
    assert not engine.accepts_adapters and "--enable-lora" not in cmd and "--lora-modules" not in cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lora_rank": -1}, r"lora_rank: must be in \[0, 512\]"),
        ({"lora_rank": 1024}, r"lora_rank: must be in \[0, 512\]"),
        ({"lora_rank": 8, "extra_args": ["--max-loras", "4"]}, "sets vLLM's LoRA flags itself"),
        ({"lora_rank": 8, "extra_args": ["--enable-lora"]}, "remove --enable-lora"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VLLMOptions(**settings)


# --- files ---------------------------------------------------------------------------------------
def test_the_adapter_files_start_at_the_base_and_follow_the_latest_version(  # type: ignore[no-untyped-def]
    tmp_path: Path, peft_model, bpe_model_dir: Path
) -> None:
    files = AdapterFiles(tmp_path / "lora", rank=4, model_dir=bpe_model_dir)
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "v9").mkdir()  # an earlier run's version: not served after a fresh start
    files.prepare()
    assert files.current.resolve() == files.empty.resolve() and files.versions() == ["v0-empty"]

    state = lora.adapter_state(peft_model)
    first, seconds = files.write(1, state.weights, state.config)
    assert first == tmp_path / "lora" / "v1" and seconds > 0
    files.point_at(first)
    files.prune()
    second, _ = files.write(2, state.weights, state.config)
    assert files.current.resolve() == first.resolve()  # `current` moves only when told
    files.point_at(second)
    files.prune()
    assert files.versions() == ["v0-empty", "v2"] and os.readlink(files.current) == "v2"  # relative
    files.reset()
    assert files.current.resolve() == files.empty.resolve() and files.versions() == ["v0-empty"]


def test_a_written_adapter_is_the_trainers_for_peft_itself(tmp_path: Path, peft_model, bpe_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """What vLLM reads is peft's own format: peft loads the directory into the base and computes the
    trainer's logits exactly; the config holds what vLLM's PEFTHelper needs."""
    import peft
    from transformers import AutoModelForCausalLM

    files = AdapterFiles(tmp_path, rank=4, model_dir=bpe_model_dir)
    state = lora.adapter_state(peft_model)
    directory, _ = files.write(3, state.weights, state.config)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"] and config["bias"] == "none"
    assert not config.get("use_dora") and not config.get("modules_to_save")  # vLLM refuses those

    base = AutoModelForCausalLM.from_pretrained(bpe_model_dir, dtype=torch.float32)
    reloaded = peft.PeftModel.from_pretrained(base, directory).eval()
    tokens = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, peft_model(tokens).logits)
        with peft_model.disable_adapter():
            plain = peft_model(tokens).logits
        assert (reloaded(tokens).logits - plain).abs().max() > 1e-3  # the adapter changes something


def test_an_adapter_above_the_servers_rank_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    files = AdapterFiles(tmp_path, rank=8, model_dir=tmp_path)  # --max-lora-rank 8
    files.write(1, {}, {"r": 8})
    with pytest.raises(ValueError, match="rank 16.*backend.lora.rank"):
        files.write(2, {}, {"r": 16})
    assert not (tmp_path / "v2").exists()


# --- run settings --------------------------------------------------------------------------------
def test_the_base_only_adapter_is_zeros_that_peft_and_vllm_load(tmp_path: Path, bpe_model_dir: Path) -> None:
    """vLLM 0.32 refuses an adapter without weights; this one has zeros on one layer: peft loads it and
    computes the base's logits exactly."""
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    files = AdapterFiles(tmp_path, rank=4, model_dir=bpe_model_dir)
    files.prepare()
    weights = load_file(files.empty / ADAPTER_WEIGHTS)
    assert weights and all(not t.any() for t in weights.values())
    config = json.loads((files.empty / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["target_modules"] == ["o_proj"] and config["bias"] == "none"
    base = AutoModelForCausalLM.from_pretrained(bpe_model_dir, dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        expected = base(tokens).logits
        served = peft.PeftModel.from_pretrained(base, files.empty).eval()
        assert torch.equal(served(tokens).logits, expected)


def test_lora_needs_the_bases_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="local directory"):
        AdapterFiles(tmp_path / "lora", rank=4, model_dir=tmp_path / "hub-name").prepare()
    with pytest.raises(ValueError, match="served_model_name.*and model"):
        VLLMEngine(VLLMConfig(options=VLLMOptions(urls=["http://127.0.0.1:9"], served_model_name="tiny", lora_rank=8)))


def _config(tmp_path: Path, **sections):  # type: ignore[no-untyped-def]
    return validate({"model": {"path": str(tmp_path), "name": "served"}, **sections})


def test_backend_lora_rank_reaches_the_vllm_engine(tmp_path: Path) -> None:
    config = _config(tmp_path, backend={"lora": {"rank": 16}}, engine={"name": "vllm"})
    options = vllm_options(config)
    assert (options.served_model_name, options.lora_rank) == ("served", 16)
    assert vllm_options(_config(tmp_path, engine={"name": "vllm"})).lora_rank == 0


def test_two_different_lora_ranks_are_refused(tmp_path: Path) -> None:
    engine = {"name": "vllm", "options": {"lora_rank": 8}}
    config = _config(tmp_path, backend={"lora": {"rank": 16}}, engine=engine)
    with pytest.raises(ConfigError, match="engine.options.lora_rank: 8 but backend.lora.rank is 16"):
        vllm_options(config)


def test_verl_with_lora_trains_the_adapter_the_engine_takes(tmp_path: Path) -> None:
    from agl_trainer.run.settings import backend_settings

    config = _config(tmp_path, backend={"name": "verl", "lora": {"rank": 8}}, engine={"name": "vllm"})
    assert backend_settings(config, str(tmp_path), cuda_available=False).training.lora.rank == 8
    assert vllm_options(config).lora_rank == 8


def test_merged_weights_with_an_untied_head_are_refused_for_a_tied_served_model(
    tmp_path: Path, bpe_model_dir: Path
) -> None:
    """A LoRA policy whose adapter covers the tied lm_head, merged, holds lm_head.weight of its own: a
    vLLM serving the tied model would load the embedding in its place, so the update is refused."""
    from agl_trainer.weights.update import WeightUpdate

    assert json.loads((bpe_model_dir / "config.json").read_text())["tie_word_embeddings"]
    options = VLLMOptions(served_model_name="tiny", python=sys.executable, weights_dir=str(tmp_path), device="cpu")
    engine = VLLMEngine(VLLMConfig(model=str(bpe_model_dir), options=options))
    head = {"lm_head.weight": torch.zeros(2, 2), "model.embed_tokens.weight": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"lm_head\.weight of their own .* engine\.options\.lora_rank > 0"):
        engine.update_weights(WeightUpdate(version=1, state_dict=head))
    assert not any(tmp_path.iterdir())  # refused before anything was written
    tied = {**head, "lm_head.weight": head["model.embed_tokens.weight"].clone()}  # as transformers lists it
    engine._check_head(WeightUpdate(version=1, state_dict=tied))  # the embedding itself: fine
