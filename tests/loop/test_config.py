"""`agl train` config: YAML + flags, validated with errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, load_config, parse_overrides, read_tasks, validate


def test_yaml_then_flags(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"id": "a"}\n{"task_id": "b", "x": 1}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "c.yaml").write_text(
        f"tasks: {tmp_path / 't.jsonl'}\nmodel: {{path: {tmp_path / 'model'}}}\n"
        "harness: {function: m:f}\nloop: {batch_rollouts: 16, group_size: 4}\n"
    )
    config = load_config(
        tmp_path / "c.yaml",
        ["--loop.group_size", "8", "--backend.lr=3e-4", "--set", "loop.mode=sync", "--sampling.train.temperature", "0.7"],
    )
    assert config.loop.group_size == 8 and config.loop.batch_rollouts == 16
    assert config.backend.lr == pytest.approx(3e-4)  # a YAML-1.1 string like 3e-4 is read as a number
    assert config.loop.mode == "sync" and config.sampling.train.temperature == 0.7
    assert config.sampling.val.temperature == 0.0  # greedy evaluation unless told otherwise
    assert [t["id"] for t in read_tasks(config.tasks)] == ["a", "b"]


def test_off_on_yes_no_are_strings_only_true_false_are_booleans(tmp_path: Path) -> None:
    """YAML 1.2's booleans, in a config file and in a flag: `importance_scope: off` is the documented
    value 'off' (PyYAML's YAML 1.1 reads off/on/yes/no as booleans: 'expected str, got bool')."""
    (tmp_path / "t.jsonl").write_text('{"id": "a"}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "c.yaml").write_text(
        f"tasks: {tmp_path / 't.jsonl'}\nmodel: {{path: {tmp_path / 'model'}}}\nharness: {{function: m:f}}\nbackend: {{algorithm: {{importance_scope: off}}}}\n"
        "viewer: {enabled: False}\n"
    )
    assert load_config(tmp_path / "c.yaml", []).backend.algorithm.importance_scope == "off"
    flagged = load_config(tmp_path / "c.yaml", ["--backend.algorithm.importance_scope=all", "--viewer.enabled=TRUE"])
    assert flagged.backend.algorithm.importance_scope == "all" and flagged.viewer.enabled is True
    assert load_config(tmp_path / "c.yaml", []).viewer.enabled is False
    assert dict(parse_overrides(["--a=off", "--b=yes", "--c=true", "--d=false"])) == {"a": "off", "b": "yes", "c": True, "d": False}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"loop": {"group_size": 0}}, "config key loop.group_size: expected int >= 1"),
        ({"loop": {"mode": "async"}}, "config key loop.mode: invalid enum value 'async' (fix: one of sync, collocated-async"),
        ({"loop": {"batch_rollout": 8}}, "config key loop.batch_rollout: unknown key (fix: did you mean loop.batch_rollouts?)"),
        ({"harness": {"timeout_s": "soon"}}, "config key harness.timeout_s: expected float, got str"),
        ({"harness": 3}, "config key harness: expected object, got int"),
    ],
)
def test_type_errors_name_the_key(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate(raw)
    assert message in str(error.value)


def test_cross_checks(tmp_path: Path) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a"}\n')
    base = [f"--tasks={tasks}", f"--model.path={tmp_path}"]
    with pytest.raises(ConfigError, match="set exactly one of harness.command"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="config key harness.command: .*does not exist"):
        load_config(None, [*base, "--harness.command=./missing-harness.sh"])
    with pytest.raises(ConfigError, match="not module:function"):
        load_config(None, [*base, "--harness.function=just_a_name"])
    with pytest.raises(ConfigError, match="config key tasks: .*does not exist"):
        load_config(None, ["--tasks=/nope.jsonl", f"--model.path={tmp_path}", "--harness.function=m:f"])
    with pytest.raises(ConfigError, match="config key backend.verl.nnode: unknown key .*backend.verl.nnodes"):
        load_config(None, [*base, "--harness.function=m:f", "--backend.name=verl", "--backend.verl.nnode=2"])
    with pytest.raises(ConfigError, match="config key backend.verl.n_gpus_per_node"):
        load_config(None, [*base, "--harness.function=m:f", "--backend.verl.n_gpus_per_node=0"])


def test_bad_tasks_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        read_tasks(path)
    path.write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(ConfigError, match="duplicate task id 'a'"):
        read_tasks(path)


def test_flag_parsing_errors() -> None:
    with pytest.raises(ConfigError, match="--set needs KEY=VALUE"):
        list(parse_overrides(["--set", "loop.mode"]))
    with pytest.raises(ConfigError, match="needs a value"):
        list(parse_overrides(["--loop.mode"]))


def test_reading_a_config_and_the_cli_load_no_torch() -> None:
    """`agl --help`, `agl train --check` and the viewer start in a fraction of a second: the config
    (assembly's section included) and the command line import no torch, transformers or litellm."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import agl_trainer.cli, agl_trainer.config, agl_trainer.assembly\n"
        "print([m for m in ('torch', 'transformers', 'litellm', 'verl') if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_traces_ls_builds_no_config_and_train_help_still_lists_the_keys(tmp_path) -> None:
    """`agl traces ls` imports neither the config (the train subcommand's epilog of config keys is
    built only when its help is shown) nor assembly nor numpy (the store reads token arrays with
    numpy only when it decodes them): a listing pays for none of them."""
    import subprocess
    import sys

    from agl_trainer.store import RolloutStore

    RolloutStore(tmp_path / "rollouts.db").close()
    code = (
        "import sys\n"
        "from agl_trainer.cli import main\n"
        f"code = main(['traces', 'ls', '--store', {str(tmp_path / 'rollouts.db')!r}])\n"
        "print(code, [m for m in ('agl_trainer.config', 'agl_trainer.assembly', 'numpy') if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "0 []"
    helped = subprocess.run(
        [sys.executable, "-c", "from agl_trainer.cli import main; main(['train', '--help'])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "config keys (default):" in helped.stdout
    assert "loop.val_sampled" in helped.stdout and "backend.lr (0.001)" in helped.stdout


def test_one_staleness_knob_the_offline_spelling_names_it() -> None:
    with pytest.raises(ConfigError, match=r"offline.max_policy_lag is now loop.staleness .*set loop.staleness to 2"):
        validate({"offline": {"max_policy_lag": 2}})
    assert validate({}).loop.staleness is None  # unset: 1 live, no bound from a store (token_age.py)
    assert validate({"loop": {"staleness": -1}}).loop.staleness == -1
    with pytest.raises(ConfigError, match="loop.staleness"):
        validate({"loop": {"staleness": -2}})


def test_a_live_run_refuses_an_unbounded_staleness(tmp_path: Path) -> None:
    from agl_trainer.loop.inflight import InFlight

    config = validate({"loop": {"staleness": -1}}).loop
    with pytest.raises(ConfigError, match="loop.staleness -1 .* is for --from-store runs"):
        InFlight(config, schedule=None, runner=None, journal=None, data=None, progress=None)  # type: ignore[arg-type]
    assert InFlight(validate({}).loop, schedule=None, runner=None, journal=None, data=None, progress=None).staleness == 1  # type: ignore[arg-type]
