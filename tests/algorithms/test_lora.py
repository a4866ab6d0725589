"""LoRA in the torch backend (backends/lora.py) on the tiny random Qwen2 (CPU): adapters over a frozen
base, merged weights equal to peft's forward, adapter-only sync into the embedded engine, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import BackendConfigError, TorchBackend
from agl_trainer.backends import lora
from agl_trainer.backends.torch_config import DEFAULT_LORA_TARGETS, LoraConfig
from agl_trainer.config import ConfigError, load_config, validate
from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from agl_trainer.run.settings import backend_settings
from agl_trainer.weights.merge import AdapterDeltas, adapter_deltas
from agl_trainer.weights.peft_files import ADAPTER_WEIGHTS
from agl_trainer.weights.update import AdapterState, WeightUpdate
from transformers import AutoModelForCausalLM

from tests.algorithms.test_torch_backend import good_and_bad_batch, mean_logprob
from tests.algorithms.tiny import VOCAB, make_tiny_model, random_batch, training_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def lora_backend(model_dir: Path, rank: int = 4, **overrides) -> TorchBackend:
    adapters = LoraConfig(rank=rank, **overrides.pop("lora", {}))
    return TorchBackend(training_config(model_dir, **{"lr": 1e-2, "lora": adapters, **overrides}))


def trained(model_dir: Path, steps: int = 2, **overrides) -> TorchBackend:
    backend = lora_backend(model_dir, **overrides)
    for version in range(steps):
        backend.train_step(random_batch(2, 2, seed=version), version)
    return backend


def base_weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    state = backend.model.get_base_model().state_dict()
    return {name: t.clone() for name, t in state.items() if ".lora_" not in name}


def adapter_weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in backend.adapter_for_engine().weights.items()}


IDS = torch.randint(2, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=IDS, use_cache=False).logits.float()


# --------------------------------------------------------------------------- the adapter's function
def test_base_plus_adapter_equals_the_merged_weights(model_dir: Path, tmp_path: Path) -> None:
    backend = trained(model_dir)
    assert all(t.abs().max() > 0 for n, t in backend.adapter_for_engine().weights.items() if "lora_B" in n)
    peft_logits = logits(backend.model)
    merged = AutoModelForCausalLM.from_pretrained(model_dir)
    merged.load_state_dict(backend.state_dict_for_engine(), strict=False)  # lm_head: tied to embed_tokens
    saved = AutoModelForCausalLM.from_pretrained(backend.save_hf(tmp_path / "hf"))
    torch.testing.assert_close(logits(merged), peft_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(saved), peft_logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(model_dir)), peft_logits, atol=1e-3)
    names = set(backend.state_dict_for_engine())
    assert names == set(AutoModelForCausalLM.from_pretrained(model_dir).state_dict()) - {"lm_head.weight"}


HEAD_TARGETS = (*DEFAULT_LORA_TARGETS, "lm_head")


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # PeftModel.from_pretrained's
def test_an_adapter_on_the_tied_output_head_merges_into_an_untied_head(
    model_dir: Path, tmp_path: Path
) -> None:
    """peft adapts the tied head's output alone (the embedding lookup stays the base's); merged, the
    head is a weight of its own and the saved config unties it, so transformers loads the policy."""
    import json

    backend = trained(model_dir, lora={"target_modules": HEAD_TARGETS})
    adapter = backend.adapter_for_engine()
    assert all(".lora_A." in n or ".lora_B." in n for n in adapter.weights)  # no embedding copied in
    head_b = adapter.weights["base_model.model.lm_head.lora_B.weight"]
    assert head_b.abs().max() > 0  # trained
    peft_logits = logits(backend.model)
    merged = backend.state_dict_for_engine()
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(merged) == set(base)  # lm_head.weight too, beside the unchanged embedding
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    untied = AutoModelForCausalLM.from_pretrained(model_dir, tie_word_embeddings=False)
    untied.load_state_dict(merged, strict=True)
    torch.testing.assert_close(logits(untied), peft_logits, atol=1e-5, rtol=1e-5)
    saved_dir = backend.save_hf(tmp_path / "hf")
    assert json.loads((saved_dir / "config.json").read_text())["tie_word_embeddings"] is False
    saved = AutoModelForCausalLM.from_pretrained(saved_dir)
    torch.testing.assert_close(logits(saved), peft_logits, atol=1e-5, rtol=1e-5)
    from peft import PeftModel

    adapter_dir = backend.save_adapter(tmp_path / "a")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir)
    torch.testing.assert_close(logits(loaded), peft_logits, atol=1e-6, rtol=1e-6)


def test_the_engine_serves_an_adapter_on_the_tied_output_head(model_dir: Path) -> None:
    """The embedded engine unties its head for the adapter (its logits are peft's); the base's tied
    full weights tie it back, a merged policy's untied ones untie it again."""

    backend = trained(model_dir, lora={"target_modules": HEAD_TARGETS})
    peft_logits = logits(backend.model)
    tied_base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    del tied_base["lm_head.weight"]  # as save_pretrained writes a tied model
    with EmbeddedEngine(EmbeddedEngineConfig(model_path=model_dir)) as engine:
        model = engine.model
        engine.update_adapter(1, backend.adapter_for_engine())
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        torch.testing.assert_close(logits(model), peft_logits, atol=1e-5, rtol=1e-5)
        engine.update_weights(WeightUpdate(2, state_dict=tied_base))
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the base again, tied
        with backend.model.disable_adapter():
            torch.testing.assert_close(logits(model), logits(backend.model), atol=1e-5, rtol=1e-5)
        engine.update_weights(WeightUpdate(3, state_dict=backend.state_dict_for_engine()))
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        torch.testing.assert_close(logits(model), peft_logits, atol=1e-5, rtol=1e-5)


def test_a_step_changes_only_the_adapter(model_dir: Path) -> None:
    backend = lora_backend(model_dir)
    trainable = {id(p) for p in backend.model.parameters() if p.requires_grad}
    assert {id(p) for group in backend.optimizer.param_groups for p in group["params"]} == trainable
    names = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    base, adapter = base_weights(backend), adapter_weights(backend)
    backend.train_step(random_batch(2, 2, seed=1), 0)
    after = base_weights(backend)
    assert all(torch.equal(after[name], base[name]) for name in base)  # the base is frozen, bit for bit
    changed = adapter_weights(backend)
    assert all(not torch.equal(changed[name], adapter[name]) for name in adapter if "lora_B" in name)


def test_rank_zero_is_the_full_training_path(model_dir: Path) -> None:
    zero = LoraConfig(rank=0, alpha=3.0, target_modules=("q_proj",))
    off = TorchBackend(training_config(model_dir, lr=1e-3, lora=zero))
    full = TorchBackend(training_config(model_dir, lr=1e-3))
    assert type(off.model) is type(full.model) and not off.uses_lora
    for version in range(2):
        batch = random_batch(2, 2, seed=version)
        norms = [backend.train_step(batch, version)["actor/grad_norm"] for backend in (off, full)]
        assert norms[0] == norms[1]
    got, want = off.state_dict_for_engine(), full.state_dict_for_engine()
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    with pytest.raises(ValueError, match="rank is 0"):
        off.adapter_for_engine()


def test_kl_reference_is_the_base_with_the_adapter_off(model_dir: Path) -> None:
    backend = trained(model_dir, algorithm=AlgorithmConfig(kl_coef=0.1))
    assert backend.ref_model is None  # no second model in memory
    with backend.model.disable_adapter():
        off = logits(backend.model)
    torch.testing.assert_close(off, logits(AutoModelForCausalLM.from_pretrained(model_dir)), atol=0, rtol=0)
    metrics = backend.train_step(random_batch(2, 2, seed=9), 2)
    assert metrics["actor/ref_kl"] != 0.0  # the adapter moved the policy off its reference


def test_steps_raise_logprob_of_rewarded_tokens(model_dir: Path) -> None:
    backend = lora_backend(model_dir, rank=8, lr=1e-2)
    batch = good_and_bad_batch()
    good, bad = {"g0", "g1", "g2"}, {"b0", "b1", "b2"}
    before = (mean_logprob(backend, batch, good), mean_logprob(backend, batch, bad))
    for version in range(4):
        backend.train_step(batch, version)
    after = (mean_logprob(backend, batch, good), mean_logprob(backend, batch, bad))
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5


# ------------------------------------------------------------------------------------- checkpoints
def test_resume_continues_exactly(model_dir: Path, tmp_path: Path) -> None:
    first = trained(model_dir, steps=1)
    first.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / ADAPTER_WEIGHTS).is_file()
    assert not (tmp_path / "ckpt" / "model").exists()  # the base is model_path's: not copied per checkpoint
    batch = random_batch(2, 2, seed=7)
    continued = first.train_step(batch, 1)
    resumed = lora_backend(model_dir)
    resumed.load_checkpoint(tmp_path / "ckpt")
    again = resumed.train_step(batch, 1)
    timings = {key for key in continued if key.endswith("_s") or key == "perf/tokens_per_s"}

    def untimed(metrics: dict[str, float]) -> dict[str, float]:
        return {key: value for key, value in metrics.items() if key not in timings}

    assert untimed(again) == untimed(continued)
    want, got = adapter_weights(first), adapter_weights(resumed)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert resumed.step == first.step == 2


def test_a_checkpoint_of_other_settings_is_refused(model_dir: Path, tmp_path: Path) -> None:
    trained(model_dir, steps=1).save_checkpoint(tmp_path / "adapter-ckpt")
    with pytest.raises(ValueError, match="r 4 \\(now 8\\)"):
        lora_backend(model_dir, rank=8).load_checkpoint(tmp_path / "adapter-ckpt")
    with pytest.raises(ValueError, match="holds an adapter but this backend trains full weights"):
        TorchBackend(training_config(model_dir)).load_checkpoint(tmp_path / "adapter-ckpt")
    TorchBackend(training_config(model_dir)).save_checkpoint(tmp_path / "full-ckpt")
    with pytest.raises(ValueError, match="holds full weights but this backend trains an adapter"):
        lora_backend(model_dir).load_checkpoint(tmp_path / "full-ckpt")


def test_the_bare_adapter_loads_in_peft(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    backend = trained(model_dir, steps=1)
    directory = backend.save_adapter(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), directory)
    torch.testing.assert_close(logits(loaded), logits(backend.model), atol=1e-6, rtol=1e-6)


# -------------------------------------------------------------------------------- adapter-only sync
def test_the_engine_serves_base_plus_each_new_adapter(model_dir: Path) -> None:
    backend = lora_backend(model_dir)
    with EmbeddedEngine(EmbeddedEngineConfig(model_path=model_dir)) as engine:
        pristine = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        for version in range(3):  # each adapter replaces the last: no accumulation
            backend.train_step(random_batch(2, 2, seed=version), version)
            adapter = backend.adapter_for_engine()
            engine.update_adapter(version + 1, adapter)
            merged, served = backend.state_dict_for_engine(), dict(engine.model.named_parameters())
            assert all(torch.equal(served[name], merged[name]) for name in merged)
            assert engine.policy_version == version + 1 and engine.last_update_bytes == adapter.nbytes
        full_bytes = sum(t.numel() * t.element_size() for t in merged.values())
        assert adapter.nbytes < full_bytes / 5
        only_q = AdapterState(
            {n: t for n, t in adapter.weights.items() if ".q_proj." in n},
            {**adapter.config, "target_modules": ["q_proj"]},
        )
        engine.update_adapter(4, only_q)  # what the new adapter leaves out goes back to the base
        served = dict(engine.model.named_parameters())
        k, q = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(served[k], pristine[k]) and not torch.equal(served[q], pristine[q])
        before = {n: p.detach().clone() for n, p in served.items()}
        nowhere = "base_model.model.model.nowhere"
        extra = {f"{nowhere}.lora_A.weight": torch.ones(4, 8), f"{nowhere}.lora_B.weight": torch.ones(8, 4)}
        bad = AdapterState({**adapter.weights, **extra}, adapter.config)
        with pytest.raises(KeyError, match="model.nowhere.weight"):
            engine.update_adapter(5, bad)
        assert engine.policy_version == 4  # refused whole: nothing changed
        assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rank": -1}, r"backend\.lora\.rank: -1 must be an integer >= 0"),
        ({"rank": 8, "alpha": 0.0}, r"backend\.lora\.alpha: 0\.0 must be positive"),
        ({"rank": 8, "dropout": 1.0}, r"backend\.lora\.dropout: 1\.0 must be in \[0, 1\)"),
        ({"rank": 8, "dropout": -0.1}, r"backend\.lora\.dropout"),
        ({"rank": 8, "target_modules": ()}, r"backend\.lora\.target_modules: \[\]"),
        ({"rank": 8, "target_modules": ("all-linear", "q_proj")}, "give it alone"),
        ({"rank": 8, "target_modules": ("q_proj", "q_proj")}, "names a module twice"),
    ],
)
def test_bad_settings_name_their_key(settings: dict, message: str) -> None:
    with pytest.raises(BackendConfigError, match=message):
        LoraConfig(**settings)


def test_targets_are_checked_against_the_model(model_dir: Path) -> None:
    unknown = (
        r"target_modules: qkv, c_fc match no linear layer of Qwen2ForCausalLM; its linear layers are "
        r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    )
    with pytest.raises(BackendConfigError, match=unknown):
        lora_backend(model_dir, lora={"target_modules": ("q_proj", "qkv", "c_fc")})
    head = lora_backend(model_dir, lora={"target_modules": ("q_proj", "lm_head")})  # tied: its output only
    assert {n.split(".lora_")[0] for n in head.adapter_for_engine().weights} >= {"base_model.model.lm_head"}
    embedding = r"embed_tokens match no linear layer .* input embedding, which agl does not adapt .* lm_head"
    with pytest.raises(BackendConfigError, match=embedding):
        lora_backend(model_dir, lora={"target_modules": ("q_proj", "embed_tokens")})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    layers = model.model.layers
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight  # another tied pair: ambiguous
    with pytest.raises(BackendConfigError, match=r"layers\.0\.self_attn\.q_proj, .*shares its weight"):
        lora.resolve_targets(model, ("q_proj",))
    everything = lora_backend(model_dir, lora={"target_modules": ("all-linear",)})
    assert sorted(everything.adapter_for_engine().config["target_modules"]) == sorted(DEFAULT_LORA_TARGETS)
    from_flag = LoraConfig(rank=8, target_modules="q_proj, v_proj")  # type: ignore[arg-type]
    assert from_flag.target_modules == ("q_proj", "v_proj")


def test_the_config_section_and_its_flags(model_dir: Path) -> None:
    flags = ["--backend.lora.rank", "8", "--backend.lora.target_modules", "q_proj,v_proj"]
    config = load_config(None, ["--model.path", str(model_dir), *flags], check_paths=False)
    settings = backend_settings(config, str(model_dir))
    assert settings.lora == LoraConfig(rank=8, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
    assert backend_settings(validate({}), str(model_dir)).lora == LoraConfig()  # off by default
    with pytest.raises(ConfigError, match=r"config key backend\.lora\.rank: expected int >= 0"):
        validate({"backend": {"lora": {"rank": -2}}})
    with pytest.raises(ConfigError, match=r"config key backend\.lora\.dropout"):
        validate({"backend": {"lora": {"dropout": 1}}})
    verl = validate({"backend": {"name": "verl", "lora": {"rank": 8}}})
    assert backend_settings(verl, str(model_dir), cuda_available=False).training.lora.rank == 8


# ---------------------------------------------------------------------------- a bfloat16 base
def check_bfloat16_base(model_dir: Path, tmp_path: Path, device: str) -> None:
    """Adapters stay float32 (their master weights) over a bfloat16 base; the merged weights come in
    the base's dtype and the step still learns."""
    backend = lora_backend(model_dir, rank=8, param_dtype="bfloat16", device=device)
    dtypes = {p.dtype for n, p in backend.model.named_parameters() if p.requires_grad}
    assert dtypes == {torch.float32}
    batch = good_and_bad_batch()
    before = mean_logprob(backend, batch, {"g0", "g1", "g2"})
    for version in range(3):
        metrics = backend.train_step(batch, version)
    assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
    assert mean_logprob(backend, batch, {"g0", "g1", "g2"}) > before
    weights = backend.state_dict_for_engine()
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in weights.values())
    backend.save_checkpoint(tmp_path / "ckpt")
    resumed = lora_backend(model_dir, rank=8, param_dtype="bfloat16", device=device)
    resumed.load_checkpoint(tmp_path / "ckpt")
    want, got = adapter_weights(backend), adapter_weights(resumed)
    assert resumed.step == 3 and all(torch.equal(got[name], want[name]) for name in want)


def test_bfloat16_base_on_cpu(model_dir: Path, tmp_path: Path) -> None:
    check_bfloat16_base(model_dir, tmp_path, "cpu")


@pytest.mark.gpu
def test_bfloat16_base_on_cuda(model_dir: Path, tmp_path: Path) -> None:
    check_bfloat16_base(model_dir, tmp_path, "cuda")


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_adapter_updates_are_computed_when_read_and_checked_without_computing(monkeypatch, fan_in_fan_out):
    """A merge reads one weight's float32 update at a time (an 8B's together are 26 GiB): membership and
    shapes come without a matmul, and each update is scaling x B @ A (transposed for fan-in-first)."""
    a, b = torch.randn(4, 6), torch.randn(10, 4)
    state = AdapterState(
        {"base_model.model.layer.q_proj.lora_A.weight": a, "base_model.model.layer.q_proj.lora_B.weight": b},
        {"r": 4, "lora_alpha": 8, "fan_in_fan_out": fan_in_fan_out},
    )
    deltas = adapter_deltas(state)
    computed = 0
    real_getitem = AdapterDeltas.__getitem__

    def counted(self, name):
        nonlocal computed
        computed += 1
        return real_getitem(self, name)

    monkeypatch.setattr(AdapterDeltas, "__getitem__", counted)
    name = "layer.q_proj.weight"
    assert name in deltas and "layer.k_proj.weight" not in deltas and list(deltas) == [name]
    expected = (b @ a) * 2.0
    expected = expected.T if fan_in_fan_out else expected
    assert deltas.shape(name) == tuple(expected.shape) and computed == 0
    assert torch.allclose(deltas[name], expected) and computed == 1
