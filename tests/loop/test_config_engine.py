"""`engine.options`, typed by `engine.name`: the embedded engine's EmbeddedOptions, vLLM's VLLMOptions.
Checked as the config is read (errors name `config key engine.options.KEY` and the fix), listed by
`agl train --help`, and taken by the engines as the config holds them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from agl_trainer.config import ConfigError, describe_keys, load_config, validate
from agl_trainer.engines.embedded.options import EmbeddedOptions
from agl_trainer.engines.vllm.config import VLLMOptions

ROOT = Path(__file__).resolve().parents[2]


def _refusal(engine: dict) -> str:
    with pytest.raises(ConfigError) as error:
        validate({"engine": engine})
    return str(error.value)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        # unknown, with the close key named
        ({"options": {"device_step": 5}},
         "config key engine.options.device_step: not a setting of engine embedded (fix: did you mean "
         "engine.options.device_step_ms?)"),
        ({"name": "vllm", "options": {"gpu_memory_util": 0.5}},
         "config key engine.options.gpu_memory_util: not a setting of engine vllm (fix: did you mean "
         "engine.options.gpu_memory_utilization?)"),
        # unknown, nothing close: every setting of that engine named
        ({"options": {"api_key": "x"}},
         "config key engine.options.api_key: not a setting of engine embedded (fix: one of host, port, "
         "max_model_len, dtype, device, torch_threads, device_step_ms, fault_skip_weight_load)"),
        # the other engine's setting (engine.name changed by a flag)
        ({"name": "embedded", "options": {"collocated": True}},
         "config key engine.options.collocated: a setting of engine vllm, not embedded (fix: remove it, or drop "
         "all of vllm's with --engine.options={})"),
        # wrong type
        ({"options": {"max_model_len": "long"}}, "config key engine.options.max_model_len: expected int | null, got str"),
        ({"name": "vllm", "options": {"extra_args": "--enforce-eager"}},
         "config key engine.options.extra_args: expected array, got str (fix: more vllm serve flags"),
        # out of range, or not one of the choices
        ({"options": {"device_step_ms": 20000}},
         "config key engine.options.device_step_ms: expected float <= 10000.0 (fix: benches: each batched step"),
        ({"options": {"device": "tpu"}}, "config key engine.options.device: expected str matching regex"),
        ({"options": {"dtype": "float8"}},
         "config key engine.options.dtype: invalid enum value 'float8' (fix: one of float32, bfloat16, float16:"),
        ({"name": "vllm", "options": {"gpu_memory_utilization": 1.5}},
         "config key engine.options.gpu_memory_utilization: expected float <= 1.0"),
        ({"name": "vllm", "options": {"max_model_len": 8}}, "config key engine.options.max_model_len: expected int >= 16"),
        ({"name": "vllm", "options": {"sleep_level": 3}},
         "config key engine.options.sleep_level: invalid enum value 3 (fix: one of 1, 2:"),
        # the engine's own check, as the config is read
        ({"name": "vllm", "options": {"urls": ["http://gpu1:8000/v1"]}},
         "config key engine.options.urls: 'http://gpu1:8000/v1' must be a base URL like http://host:8000 (no /v1)"),
        ({"name": "sglang"}, "config key engine.name: invalid value 'sglang' (fix: one of embedded, vllm: inference engine"),
    ],
)  # fmt: skip
def test_a_bad_engine_option_is_refused_as_the_config_is_read(engine: dict, message: str) -> None:
    assert _refusal(engine).startswith(message), _refusal(engine)


def test_dry_run_refuses_a_bad_engine_option_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agl_trainer.cli import main

    monkeypatch.chdir(ROOT)
    code = main(["train", "examples/demo/config.yaml", "--dry-run", "--engine.options.device_step_ms=-1"])
    captured = capsys.readouterr()
    assert code == 2 and "config key engine.options.device_step_ms: expected float >= 0.0" in captured.err
    assert "config OK" not in captured.out


def test_dry_run_refuses_vllm_options_that_disagree_with_the_rest_of_the_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What VLLMConfig checks across sections (one port per engine.replicas) is refused by --dry-run too."""
    from agl_trainer.cli import main

    monkeypatch.chdir(ROOT)
    code = main(["train", "examples/swe/config.yaml", "--dry-run", "--engine.options.ports=[8000]"])
    captured = capsys.readouterr()
    assert code == 2, captured.out
    assert "config key engine.options.ports: 1 entries for 8 replicas (fix: one per replica or none)" in captured.err


def test_each_engine_takes_its_own_options_with_the_yaml_spelling(tmp_path: Path) -> None:
    """The spellings examples/, bench/ and tests/ use keep their meaning: a YAML section and flags."""
    swe = load_config(ROOT / "examples/swe/config.yaml", check_paths=False)
    assert isinstance(swe.engine.options, VLLMOptions) and swe.engine.name == "vllm" and swe.engine.replicas == 8
    assert (swe.engine.options.gpu_memory_utilization, swe.engine.options.max_model_len) == (0.6, 32768)
    assert swe.engine.options.collocated
    gpu = load_config(ROOT / "examples/hops/config-gpu.yaml", check_paths=False)
    assert gpu.engine.options == EmbeddedOptions(device="cuda")
    flags = ["--engine.options.device_step_ms=25", "--engine.options.dtype=bfloat16",
             "--engine.options.fault_skip_weight_load=true"]  # fmt: skip
    demo = load_config(ROOT / "examples/demo/config.yaml", flags, check_paths=False)
    assert demo.engine.options == EmbeddedOptions(device_step_ms=25.0, dtype="bfloat16", fault_skip_weight_load=True)
    vllm = load_config(None, ["--engine.name=vllm", "--engine.options.python=/opt/py", "--engine.options.log_dir=l",
                              "--engine.options.served_model_name=tiny", "--engine.options.device_step_ms=5"],
                       check_paths=False)  # fmt: skip
    assert vllm.engine.options == VLLMOptions(python="/opt/py", log_dir="l", served_model_name="tiny", device_step_ms=5)
    assert validate({}).engine.options == EmbeddedOptions()  # no engine section: the embedded engine's defaults


def test_train_help_lists_each_engines_options_from_their_structs(capsys: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for engine, struct in (("embedded", EmbeddedOptions), ("vllm", VLLMOptions)):
        for field in msgspec.structs.fields(struct):
            assert f"engine.options.{field.name}" in out, (engine, field.name)
    assert "engine.options.device_step_ms (0.0)\n      (embedded) benches:" in out
    assert "engine.options.gpu_memory_utilization\n      (vllm) GPU only" in out
    assert "engine.name (embedded)\n      inference engine" in out
    only_vllm = [key for key, _, _ in describe_keys("vllm") if key.startswith("engine.options.")]
    assert only_vllm == [f"engine.options.{field.name}" for field in msgspec.structs.fields(VLLMOptions)]


def test_the_engines_take_the_typed_options_as_the_config_holds_them(tmp_path: Path) -> None:
    from agl_trainer.engines.embedded.engine import EmbeddedEngine
    from agl_trainer.engines.vllm.engine import VLLMEngine
    from agl_trainer.run.build import build_engine

    config = validate({"model": {"name": "served"}, "engine": {"max_batch": 8, "options": {"max_model_len": 64}}})
    embedded = build_engine(config, str(tmp_path))  # not started: nothing loaded
    assert isinstance(embedded, EmbeddedEngine) and embedded.options is config.engine.options
    assert (embedded.config.max_batch_size, embedded.config.served_model_name) == (8, "served")

    options = {"device": "cpu", "max_model_len": 64, "extra_args": ["--seed", "1"], "env": {"A": "1"}}
    config = validate({"model": {"name": "served"}, "backend": {"lora": {"rank": 8}},
                       "engine": {"name": "vllm", "replicas": 2, "options": options}})  # fmt: skip
    engine = build_engine(config, str(tmp_path))
    assert isinstance(engine, VLLMEngine) and (engine.config.model, engine.config.replicas) == (str(tmp_path), 2)
    # the config's options, but for what other sections own: the name served and backend.lora.rank
    given = config.engine.options
    assert engine.config.options == msgspec.structs.replace(given, served_model_name="served", lora_rank=8)
    assert given.lora_rank == 0 and given.served_model_name is None  # the config itself is as it was read
    assert engine.accepts_adapters and "--max-model-len" in engine.command(8000)


def test_the_engine_name_is_recorded_with_its_options() -> None:
    """A run's config.yaml and a receipt's resolved config keep engine.name (the section's tag, no field):
    read back, they choose the same engine's options."""
    import yaml

    from agl_trainer.config import dump_config, resolved_config

    config = validate({"engine": {"name": "vllm", "options": {"max_model_len": 64}}})
    resolved = resolved_config(config)["engine"]
    assert resolved["name"] == "vllm" and resolved["options"]["max_model_len"] == 64
    assert resolved["options"]["weight_sync"] == "in_place"  # defaults included
    assert validate(yaml.safe_load(dump_config(config))) == config
    assert validate(resolved_config(config)) == config
