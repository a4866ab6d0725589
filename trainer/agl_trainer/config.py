"""`agl train` configuration: one YAML file, every key also a command-line flag.

The config is typed once, in config_schema.py (msgspec Structs), and read and validated here before
anything starts. Errors name the key and say how to fix it:

    config key loop.group_size: expected int >= 1, got 0 (fix: set loop.group_size to 1 or more)

Overrides: `--loop.batch_rollouts 64`, `--loop.batch_rollouts=64` or `--set loop.batch_rollouts=64`;
values are read as YAML scalars (`1e-3`, `true`, `[a, b]`). `describe_keys()` lists every key with
its default and meaning (`agl train --help` prints it).
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from agl._yaml import load_yaml
from agl_trainer.config_schema import ENGINES
from agl_trainer.config_schema import (  # re-exported: callers import the config from here
    Config as Config,
    ConfigError as ConfigError,
    LoopConfig as LoopConfig,
    harness_argv as harness_argv,
)

# --- loading ---------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, check_paths: bool = True) -> Config:
    """Read YAML at `path` (or start from defaults), apply `overrides`, validate, and return a Config."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    config = validate(raw)
    if check_paths:
        check_config(config, base=Path(path).parent if path else Path.cwd())
    return config


# Keys renamed: the old spelling is refused with the new one named (a silent alias would let two
# spellings of one bound disagree).
RENAMED = {
    ("offline", "max_policy_lag"): (
        "loop.staleness",
        "one bound on a trained token's age for live and stored rollouts; -1: no bound, the old default",
    ),
}


def validate(raw: dict[str, Any]) -> Config:
    for (section, key), (new, why) in RENAMED.items():
        part = raw.get(section)
        if isinstance(part, dict) and key in part:
            raise ConfigError(
                f"config key {section}.{key} is now {new} ({why}); fix: set {new} to {part[key]!r} instead"
            )
    engine = raw.get("engine")
    if isinstance(engine, dict) and "name" not in engine:  # engine.name tags the section: embedded by default
        engine = {"name": "embedded", **engine}
        raw = {**raw, "engine": engine}
    try:
        return msgspec.convert(raw, Config, strict=False)  # strict=False: "1e-3" from a flag is a float
    except msgspec.ValidationError as error:
        name = engine.get("name") if isinstance(engine, dict) else None
        raise ConfigError(_explain(str(error), name if isinstance(name, str) else None)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (fix: pass the path of a YAML file)")
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    except UnicodeDecodeError as error:  # read_text: a binary or Latin-1 file
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {error.start}; fix: save it as UTF-8)") from None
    except OSError as error:  # unreadable (permissions)
        raise ConfigError(f"config file {path} cannot be read: {error.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def parse_overrides(args: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """`--a.b 1`, `--a.b=1`, `--set a.b=1` -> ("a.b", 1); values parsed as YAML scalars."""
    import yaml

    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        if arg == "--set":
            if i + 1 >= len(items) or "=" not in items[i + 1]:
                raise ConfigError("--set needs KEY=VALUE, for example --set loop.batch_rollouts=64")
            key, text = items[i + 1].split("=", 1)
            i += 2
        elif arg.startswith("--") and len(arg) > 2:
            if "=" in arg:
                key, text = arg[2:].split("=", 1)
                i += 1
            elif i + 1 < len(items) and not items[i + 1].startswith("--"):
                key, text = arg[2:], items[i + 1]
                i += 2
            else:
                raise ConfigError(f"flag {arg} needs a value, for example {arg}=VALUE")
        else:
            raise ConfigError(f"unexpected argument {arg!r} (config keys are flags: --loop.group_size 8)")
        key = key.strip().replace("-", "_") if not key.startswith("harness.env.") else key
        try:
            value = load_yaml(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        yield key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _explain(message: str, engine: str | None = None) -> str:
    """Rephrase a msgspec validation error as 'config key K: problem (fix: ...)'; `engine` (engine.name)
    says whose engine.options the keys are."""
    match = _AT.search(message)
    path = match.group("path") if match else ""
    key = re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
    problem = _AT.sub("", message)
    keys = describe_keys(engine)
    unknown = re.match(r"Object contains unknown field `(?P<name>[^`]+)`", problem)
    if unknown:
        name = unknown.group("name")
        full = f"{key}.{name}" if key else name
        known = [k for k, _, _ in keys]
        close = difflib.get_close_matches(full, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see `agl train --help` for the keys"
        if key.endswith(".options"):  # settings by name: the close one, else all of them
            names = [k.removeprefix(key + ".") for k in known if k.startswith(key + ".")]
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f"did you mean {key}.{close[0]}?" if close else f"one of {', '.join(names)}"
            if key == "engine.options":
                others = [e for e in ENGINES if e != engine and full in (k for k, _, _ in describe_keys(e))]
                if others:  # engine.name changed (a flag) over the other engine's options
                    hint = f"remove it, or drop all of {others[0]}'s with --engine.options={{}}"
                    return f"config key {full}: a setting of engine {others[0]}, not {engine} (fix: {hint})"
                return f"config key {full}: not a setting of engine {engine} (fix: {hint})"
            return f"config key {key}: unknown setting {name} (fix: {hint})"
        return f"config key {full}: unknown key (fix: {hint})"
    own = _section_check(key, problem)
    if own is not None:
        return own
    problem = problem.replace("`", "")
    problem = problem[0].lower() + problem[1:] if problem else problem
    fix = _fix_for(key, keys, engine)
    return f"config key {key or '(top level)'}: {problem}" + (f" (fix: {fix})" if fix else "")


def _section_check(key: str, problem: str) -> str | None:
    """A section's own check (its `__post_init__`, e.g. backend.lora's) names the key it refuses, whole
    (`backend.lora.target_modules: ...`) or from the section's name on (`algorithm.kl_coef: ...`):
    said as that key, once, with the check's own words and fix."""
    parts = key.split(".") if key else []
    for start in range(len(parts)):
        named = ".".join(parts[start:])
        if problem.startswith(named + ".") and re.match(r"[\w.]+: ", problem):
            return f"config key {'.'.join([*parts[:start], problem])}"
    return None


def _fix_for(key: str, keys: list[tuple[str, Any, str]], engine: str | None) -> str:
    for name, default, description in keys:
        if name == key:
            choices = _choices(key, engine)
            text = f"one of {', '.join(choices)}: {description}" if choices else description
            return f"{text}; default {default!r}" if default is not None else text
    return ""


def _tagged(node: Any) -> list[Any] | None:
    """The members of a union of tagged Structs (the engine section, tagged by engine.name), else None."""
    if isinstance(node, msgspec.inspect.UnionType) and all(
        isinstance(t, msgspec.inspect.StructType) and t.tag is not None for t in node.types
    ):
        return list(node.types)
    return None


def _choices(key: str, engine: str | None = None) -> list[str]:
    """The allowed values of a Literal-typed key, in declaration order (engine.options.*: `engine`'s)."""
    node: Any = msgspec.inspect.type_info(Config)
    python_type: Any = None
    for part in key.split("."):
        node = node.type if isinstance(node, msgspec.inspect.Metadata) else node
        members = _tagged(node)
        if members is not None:
            if part == members[0].tag_field:
                return [str(t.tag) for t in members]
            node = next((t for t in members if t.tag == engine), members[0])
        if not isinstance(node, msgspec.inspect.StructType):
            return []
        match = [f for f in node.fields if f.name == part]
        if not match:
            return []
        python_type = next(f.type for f in msgspec.structs.fields(node.cls) if f.name == part)
        node = match[0].type
    literal = getattr(python_type, "__origin__", None) if getattr(python_type, "__metadata__", None) else python_type
    if getattr(literal, "__origin__", None) is Literal:
        return [str(value) for value in literal.__args__]
    return []


def _description(info: Any) -> str:
    if isinstance(info, msgspec.inspect.Metadata):
        return (info.extra_json_schema or {}).get("description", "") or ""
    return ""


def describe_keys(engine: str | None = None) -> list[tuple[str, Any, str]]:
    """Every config key as (dotted name, default, description), in declaration order. The engine
    section's keys depend on engine.name: `engine` lists that engine's; None lists every engine's,
    each one's own keys marked with its name (`agl train --help`)."""
    out: list[tuple[str, Any, str]] = []

    def walk(fields: Sequence[Any], prefix: str, mark: str = "") -> None:
        for field in fields:
            name = prefix + field.name
            ftype = field.type
            if isinstance(ftype, msgspec.inspect.StructType):
                walk(ftype.fields, name + ".", mark)
                continue
            members = _tagged(ftype.type if isinstance(ftype, msgspec.inspect.Metadata) else ftype)
            if members is not None:  # the tag, the keys every member has, then each member's own
                default = field.default_factory.__struct_config__.tag  # the default member's tag
                out.append((f"{name}.{members[0].tag_field}", default, _description(ftype)))
                shared = [f for f in members[0].fields if all(f in m.fields for m in members)]
                walk(shared, name + ".", mark)
                for member in members:
                    if engine in (None, member.tag):
                        own = [f for f in member.fields if f not in shared]
                        walk(own, name + ".", f"({member.tag}) " if engine is None else mark)
                continue
            description = _description(ftype)
            default = None
            if field.default is not msgspec.NODEFAULT:
                default = field.default
            out.append((name, default, mark + description))

    config = msgspec.inspect.type_info(Config)
    assert isinstance(config, msgspec.inspect.StructType)
    walk(config.fields, "")
    return out


# --- checks beyond types ---------------------------------------------------------------------


def check_config(config: Config, base: Path) -> None:
    """Cross-field checks and the things that must exist before anything starts."""
    loop, harness = config.loop, config.harness
    if config.tasks is None:
        raise ConfigError("config key tasks: missing (fix: set tasks to a JSONL file, one task per line)")
    if not Path(config.tasks).is_file():
        raise ConfigError(f"config key tasks: {config.tasks} does not exist (fix: point it at a JSONL file)")
    check_val_tasks(config)
    if harness.runner == "kubernetes":  # the command runs in the image: nothing to find on this machine
        from agl_trainer.runners.kubernetes_config import check_kubernetes

        check_kubernetes(config)
    elif (harness.command is None) == (harness.function is None):
        raise ConfigError(
            "config key harness: set exactly one of harness.command (a program run per rollout) "
            "or harness.function (module:function called per rollout)"
        )
    if harness.command is not None and harness.runner != "kubernetes":
        argv = harness_argv(harness.command)
        if not argv:
            raise ConfigError("config key harness.command: empty (fix: the program to run per rollout)")
        _check_program("harness.command", argv[0], harness.cwd)
    if harness.grader is not None:
        argv = harness_argv(harness.grader)
        if not argv:
            raise ConfigError("config key harness.grader: empty (fix: remove it or name a program)")
        _check_program("harness.grader", argv[0], harness.cwd)
    if harness.function is not None and not re.fullmatch(r"[\w.]+:[\w.]+", harness.function):
        raise ConfigError(
            f"config key harness.function: {harness.function!r} is not module:function "
            "(fix: for example examples.demo.harness:run_episode)"
        )
    if harness.runner == "kubernetes" and not harness.image:
        raise ConfigError("config key harness.image: the kubernetes runner needs a container image")
    check_loop(loop)
    if loop.switch == "keep" and loop.mode != "collocated-async":
        raise ConfigError(
            "config key loop.switch: keep freezes calls in flight across an update, which only "
            "loop.mode=collocated-async has (fix: loop.switch=drain, or loop.mode=collocated-async)"
        )
    if loop.generate_during_training and loop.switch != "keep":
        raise ConfigError(
            "config key loop.generate_during_training: generation goes on while the trainer trains only if "
            "the weight load can freeze the calls in flight (fix: loop.switch=keep, or set it false)"
        )
    if config.model.path is None:
        raise ConfigError("config key model.path: missing (fix: a Hugging Face model directory)")
    if not Path(config.model.path).exists():
        raise ConfigError(f"config key model.path: {config.model.path} does not exist (fix: a model directory)")


def check_loop(loop: LoopConfig) -> None:
    """The loop's batch in groups (live runs and --from-store alike)."""
    if loop.batch_rollouts % loop.group_size:
        raise ConfigError(
            f"config key loop.batch_rollouts: {loop.batch_rollouts} is not a multiple of loop.group_size="
            f"{loop.group_size} (fix: use {max(1, loop.batch_rollouts // loop.group_size) * loop.group_size})"
        )
    if loop.skip_flat_groups and loop.group_size < 2:
        raise ConfigError(
            "config key loop.skip_flat_groups: a group of one rollout has no spread of rewards to judge "
            f"(loop.group_size={loop.group_size}; fix: loop.group_size 2 or more, or skip_flat_groups false)"
        )
    if loop.revisit_mixed and loop.group_size < 2:
        raise ConfigError(
            "config key loop.revisit_mixed: a group of one rollout never has mixed rewards "
            f"(loop.group_size={loop.group_size}; fix: loop.group_size 2 or more, or revisit_mixed 0)"
        )


def _check_program(key: str, program: str, cwd: str | None) -> None:
    if "/" in program:
        candidate = Path(cwd or ".") / program if not Path(program).is_absolute() else Path(program)
        if not candidate.exists():
            raise ConfigError(f"config key {key}: {program} does not exist (fix: check the path)")
        return
    if shutil.which(program) is None:
        raise ConfigError(f"config key {key}: program {program!r} is not on PATH (fix: install it or give its path)")


def check_val_tasks(config: Config) -> None:
    """val_tasks and loop.val_every go together; the file must be readable tasks held out from `tasks`."""
    every, path = config.loop.val_every, config.val_tasks
    if every > 0 and path is None:
        raise ConfigError(
            f"config key loop.val_every: {every} needs held-out tasks (fix: set val_tasks to a JSONL file "
            "of tasks not in `tasks`, or loop.val_every to 0)"
        )
    if path is None:
        return
    if not Path(path).is_file():
        raise ConfigError(f"config key val_tasks: {path} does not exist (fix: point it at a JSONL file)")
    if config.tasks is not None and Path(path).resolve() == Path(config.tasks).resolve():
        raise ConfigError(
            f"config key val_tasks: {path} is the training tasks file; validation needs held-out tasks "
            "(fix: a separate JSONL file)"
        )
    read_val_tasks(path)


def read_val_tasks(path: str | Path) -> list[dict[str, Any]]:
    """read_tasks for `val_tasks`: its errors name the config key."""
    try:
        return read_tasks(path)
    except ConfigError as error:
        raise ConfigError(f"config key val_tasks: {error}") from None


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The tasks, each a JSON object with an `id` (added as the line number when missing)."""
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"tasks file {path} line {number}: not JSON ({error.msg})") from None
            if not isinstance(task, dict):
                raise ConfigError(f"tasks file {path} line {number}: a task must be a JSON object")
            task_id = str(task.get("id", task.get("task_id", f"task-{number}")))
            if task_id in seen:
                raise ConfigError(f"tasks file {path} line {number}: duplicate task id {task_id!r}")
            seen.add(task_id)
            task.setdefault("id", task_id)
            tasks.append(task)
    if not tasks:
        raise ConfigError(f"tasks file {path} holds no tasks (fix: one JSON object per line)")
    return tasks


def dump_config(config: Config) -> str:
    """The config as YAML for OUTPUT_DIR/config.yaml: a record of the run, its secrets redacted
    (agl_trainer.redaction), so it is not a config to run again with secrets in it."""
    import yaml

    from agl_trainer.redaction import redact

    return yaml.safe_dump(redact(msgspec.to_builtins(config)), sort_keys=False)


def resolved_config(config: Any) -> Any:
    """Every key with its value, defaults included (the config's own encoding omits defaults): what a
    receipt and an experiment tracker record."""
    if isinstance(config, msgspec.Struct):
        tagged = config.__struct_config__  # the engine section: its tag (engine.name) is no field
        tag = {tagged.tag_field: tagged.tag} if tagged.tag_field is not None else {}
        return tag | {f.name: resolved_config(getattr(config, f.name)) for f in msgspec.structs.fields(config)}
    return msgspec.to_builtins(config)


if __name__ == "__main__":  # pragma: no cover - a quick way to list the keys
    for key, default, description in describe_keys():
        print(f"{key:32} {default!r:>12}  {description}", file=sys.stdout)
