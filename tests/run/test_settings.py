"""The backend's and engine's settings as `agl train` and `--dry-run` both build them (run/settings.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, validate
from agl_trainer.run.settings import backend_settings, vllm_options


def _config(tmp_path: Path, **sections):
    return validate({"model": {"path": str(tmp_path), "name": "served"}, **sections})


def test_verl_weight_sync_reaches_the_vllm_engine(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        backend={"name": "verl", "verl": {"weight_sync": "nccl"}},
        engine={"name": "vllm", "options": {"dtype": "bfloat16"}},
    )
    options = vllm_options(config)
    assert (options.served_model_name, options.dtype, options.weight_sync) == ("served", "bfloat16", "nccl")
    assert options.lora_rank == 0 and config.engine.options.weight_sync == "in_place"  # the config's own: as read


def test_torch_backend_keeps_the_engines_own_weight_sync(tmp_path: Path) -> None:
    config = _config(tmp_path, engine={"name": "vllm", "options": {"weight_sync": "cuda_ipc"}})
    assert vllm_options(config).weight_sync == "cuda_ipc"


def test_two_different_weight_syncs_are_refused(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        backend={"name": "verl", "verl": {"weight_sync": "in_place"}},
        engine={"name": "vllm", "options": {"weight_sync": "nccl"}},
    )
    with pytest.raises(ConfigError, match="engine.options.weight_sync: 'nccl' but backend.verl.weight_sync is 'in_place'"):
        vllm_options(config)


def test_backend_errors_name_the_key_once(tmp_path: Path) -> None:
    config = _config(tmp_path, backend={"options": {"micro_batch_tokens": 0}})
    with pytest.raises(ConfigError, match=r"^config key backend\.micro_batch_tokens: 0 must be positive"):
        backend_settings(config, str(tmp_path))
    with pytest.raises(ConfigError, match="config key backend.options: .*no_such_option"):
        _config(tmp_path, backend={"options": {"no_such_option": 1}})  # refused as the config is read


def test_the_backends_take_the_config_sections_as_they_are(tmp_path: Path) -> None:
    """One declaration per key: `backend.lora` is the backends' LoraConfig, `backend.options` the
    TrainingOptions that TorchBackendConfig extends, `backend.verl` the VerlSettings that
    VerlBackendConfig extends, `backend.algorithm` the AlgorithmSettings that AlgorithmConfig
    extends; every value set reaches the backend's settings unchanged."""
    import msgspec
    from agl_trainer.backends.settings import LoraConfig, TrainingOptions, VerlSettings

    options = {"micro_batch_tokens": 1234, "ppo_epochs": 3, "betas": [0.8, 0.9], "packing": "padded"}
    verl = {"nnodes": 1, "n_gpus_per_node": 2, "override": {"engine.use_dynamic_bsz": True}}
    lora = {"rank": 4, "target_modules": "q_proj, v_proj"}
    algorithm = {"advantage_estimator": "rloo", "kl_coef": 0.05}
    config = _config(tmp_path, backend={"name": "verl", "device": "cpu", "options": options, "verl": verl, "lora": lora,
                                        "algorithm": algorithm})  # fmt: skip
    assert isinstance(config.backend.options, TrainingOptions) and isinstance(config.backend.verl, VerlSettings)
    assert config.backend.lora == LoraConfig(rank=4, target_modules=("q_proj", "v_proj"))
    settings = backend_settings(config, str(tmp_path), cuda_available=False)
    training = settings.training
    assert training.lora is config.backend.lora  # the section itself, not a copy of its fields
    for name in msgspec.structs.asdict(config.backend.options):
        assert getattr(training, name) == getattr(config.backend.options, name), name
    assert (training.micro_batch_tokens, training.ppo_epochs, training.betas) == (1234, 3, (0.8, 0.9))
    assert (training.algorithm.advantage_estimator, training.algorithm.kl_coef) == ("rloo", 0.05)
    resolved = {**msgspec.structs.asdict(config.backend.algorithm), "loss_temperature": 1.0}  # sampling.train's
    assert msgspec.structs.asdict(training.algorithm) == resolved
    assert isinstance(settings, VerlSettings) and settings.n_gpus_per_node == 2
    assert settings.override == {"engine.use_dynamic_bsz": True} and settings.rollouts_per_batch == 64


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"options": {"micro_batch_tokens": "many"}}, "config key backend.options.micro_batch_tokens: expected int, got str"),
        ({"options": {"micro_batch_tokenz": 1}}, "config key backend.options: unknown setting micro_batch_tokenz (fix: did you mean backend.options.micro_batch_tokens?)"),
        ({"verl": {"nnodes": 0}}, "config key backend.verl.nnodes: expected int >= 1"),
        ({"lora": {"rank": 8, "target_modules": ["q_proj", "q_proj"]}}, "config key backend.lora.target_modules: ['q_proj', 'q_proj'] names a module twice"),
        ({"lora": {"target_modules": ["all-linear", "q_proj"]}}, "config key backend.lora.target_modules: all-linear already names every linear layer; give it alone"),
        ({"algorithm": {"kl_coeff": 0.1}}, "config key backend.algorithm.kl_coeff: unknown key (fix: did you mean backend.algorithm.kl_coef?)"),
        ({"algorithm": {"kl_coef": "high"}}, "config key backend.algorithm.kl_coef: expected float, got str"),
        ({"algorithm": {"kl_coef": -1}}, "config key backend.algorithm.kl_coef: -1.0 must be >= 0"),
        ({"algorithm": {"loss_agg_mode": "mean"}}, "config key backend.algorithm.loss_agg_mode: 'mean' is not one of"),
        ({"algorithm": {"advantage_unit": "turn"}}, "config key backend.algorithm.advantage_unit: 'turn' is not one of ['rollout', 'sample']"),
        ({"algorithm": {"loss_temperature": 0}}, "config key backend.algorithm.loss_temperature: 0.0 must be in (0, 100]"),
        ({"algorithm": {"loss_temperature": -0.5}}, "config key backend.algorithm.loss_temperature: -0.5 must be in (0, 100]"),
        ({"algorithm": {"loss_temperature": "warm"}}, "config key backend.algorithm.loss_temperature: expected float | null, got str"),
        ({"algorithm": {"loss_temperature": 0.7, "bypass_old_logprobs": True}}, "config key backend.algorithm.bypass_old_logprobs: takes the engine's log-probs (the model's own, temperature 1) as PPO's old log-probs, but the loss trains at temperature 0.7; set backend.algorithm.loss_temperature: 1.0"),
    ],
)
def test_a_bad_section_value_is_named_where_the_config_is_read_or_built(
    tmp_path: Path, sections: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        backend_settings(_config(tmp_path, backend=sections), str(tmp_path))
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize(
    ("sampled", "set_to", "trained"),
    [(0.6, None, 0.6), (1.3, None, 1.3), (0.0, None, 1.0), (0.6, 1.0, 1.0), (1.0, 0.5, 0.5)],
)
def test_the_loss_trains_at_the_sampling_temperature_unless_set(
    tmp_path: Path, sampled: float, set_to: float | None, trained: float
) -> None:
    """backend.algorithm.loss_temperature null: the distribution the training rollouts were sampled
    from (sampling.train.temperature; the model's own where that is greedy); a value: that one. Both
    backends get the resolved value."""
    algorithm = {} if set_to is None else {"loss_temperature": set_to}
    for name in ("torch", "verl"):
        config = _config(
            tmp_path,
            sampling={"train": {"temperature": sampled}},
            backend={"name": name, "device": "cpu", "algorithm": algorithm},
        )
        settings = backend_settings(config, str(tmp_path), cuda_available=False)
        training = settings if name == "torch" else settings.training
        assert training.algorithm.temperature == trained, name
    with pytest.raises(ConfigError, match="bypass_old_logprobs: .* the loss trains at temperature 0.6; set"):
        backend_settings(
            _config(tmp_path, sampling={"train": {"temperature": 0.6}}, backend={"algorithm": {"bypass_old_logprobs": True}}),
            str(tmp_path),
        )


def test_train_help_lists_every_key_of_the_sections_from_their_structs(capsys: pytest.CaptureFixture[str]) -> None:
    import msgspec
    from agl_trainer.backends.settings import LoraConfig, TrainingOptions, VerlSettings
    from agl_trainer.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    from agl_trainer.algorithms.settings import AlgorithmSettings

    sections = (("options", TrainingOptions), ("verl", VerlSettings), ("lora", LoraConfig), ("algorithm", AlgorithmSettings))
    for section, struct in sections:
        for field in msgspec.structs.fields(struct):
            assert f"backend.{section}.{field.name}" in out, (section, field.name)
    assert "backend.options.micro_batch_tokens (8192)" in out  # its default, from the struct
