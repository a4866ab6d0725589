"""Secrets never leave the machine: a unique secret planted in every place the config can carry one
(the sidecar's admin token, a harness.env value, the password of --model-url, a free-form engine
option named like a key) is found in no file `agl eval` writes
(receipt.json, results.json, config.yaml, the W&B offline run and its logs, the MLflow file store,
the sidecar's log) and in none of its output."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from agl_trainer.cli import main

DEMO_CONFIG = "examples/demo/config.yaml"


def _planted(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex}"


PRIVATE = ("auth.json", "harness.env")  # the files that exist to hold secrets (mode 0600), read back by --resume


def files_holding(root: Path, secrets: dict[str, str]) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in PRIVATE):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)}: {name}" for name, value in secrets.items() if value.encode() in data]
    return found


@pytest.mark.slow
def test_agl_eval_writes_no_planted_secret_anywhere(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from examples.demo.model import build_demo_model
    from examples.demo.run import write_val_tasks

    model = build_demo_model(tmp_path / "model")
    tasks = write_val_tasks(tmp_path / "val.jsonl", 2, 0)
    secrets = {name: _planted(name) for name in ("admin_token", "harness_env", "model_url_password", "option_key")}
    out = tmp_path / "eval"
    with EmbeddedEngine(EmbeddedEngineConfig(model_path=str(model), served_model_name="tiny")) as engine:
        host = engine.urls[0].split("://", 1)[1]
        argv = [
            "eval", DEMO_CONFIG, f"--model-url=http://agl:{secrets['model_url_password']}@{host}/v1",
            f"--val_tasks={tasks}", f"--tasks={tasks}", "--eval.k=1", f"--eval.output_dir={out}",
            f"--sidecar.admin_token={secrets['admin_token']}",
            f"--harness.env={{TOOL_API: {secrets['harness_env']}, PLAIN: visible}}",
            "--metrics.trackers=[wandb, mlflow]", "--metrics.wandb.mode=offline",
            "--metrics.wandb.run_name=secrets", "--engine.name=vllm",  # a typed engine option holding a secret:
            f"--engine.options={{env: {{HF_TOKEN: {secrets['option_key']}}}}}",  # the engine is not started
            f"--metrics.mlflow.tracking_uri={(tmp_path / 'mlruns').as_uri()}",
            "--viewer.enabled=false", "--diagnostics.canary.enabled=false", "--loop.completion_grace_s=0.2",
        ]  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["agl", *argv])  # as typed: W&B records the command line
        assert main(argv) == 0
    printed = capfd.readouterr()
    assert (out / "receipt.json").is_file() and list((out / "wandb").glob("offline-run-*"))
    leaks = files_holding(out, secrets) + files_holding(tmp_path / "mlruns", secrets)
    assert leaks == [], "\n".join(leaks)
    assert [name for name, value in secrets.items() if value in printed.out + printed.err] == []
    for name in PRIVATE:
        assert not (out / name).exists() or (out / name).stat().st_mode & 0o077 == 0, name
    receipt = (out / "receipt.json").read_text()
    # What is not a secret stays readable: the variable's name, the URL's host, counts named like keys.
    assert '"PLAIN": "<redacted>"' in receipt and f"http://<redacted>@{host}/v1" in receipt
    assert '"token_cache_bytes"' not in receipt or "<redacted>" in receipt


def test_the_redaction_rule_names_secrets_by_key_harness_env_and_url_userinfo() -> None:
    from agl_trainer.redaction import REDACTED, redact, redact_argv, redact_text

    config = {
        "sidecar": {"admin_token": "t0ken-value", "admin_token_env": "MY_ADMIN_TOKEN", "url": "http://u:pw@h:1"},
        "harness": {"env": {"ANY_NAME": "hidden-value", "EMPTY": ""}, "command": ["run", "--x"]},
        "engine": {"options": {"apiKey": "k1", "client_secret": ["s1"], "max_tokens": 512, "tokenizer": "/p"}},
        "receiver": {"token_env": "AGL_RECEIVER_TOKEN"},
        "metrics": {"mlflow": {"tracking_uri": "https://bob:pw@mlflow.example:5000"}},
    }
    assert redact(config) == {
        "sidecar": {"admin_token": REDACTED, "admin_token_env": "MY_ADMIN_TOKEN", "url": f"http://{REDACTED}@h:1"},
        "harness": {"env": {"ANY_NAME": REDACTED, "EMPTY": ""}, "command": ["run", "--x"]},
        "engine": {"options": {"apiKey": REDACTED, "client_secret": [REDACTED], "max_tokens": 512, "tokenizer": "/p"}},
        "receiver": {"token_env": "AGL_RECEIVER_TOKEN"},  # names a variable: kept
        "metrics": {"mlflow": {"tracking_uri": f"https://{REDACTED}@mlflow.example:5000"}},
    }
    assert redact({"agl": {"config": config}})["agl"]["config"] == redact(config)  # nested, as in a receipt
    assert redact_argv(["agl", "eval", "--sidecar.admin_token", "abc", "--harness.env.K=v", "--api-key=z",
                        "--model-url", "http://a:b@h/v1", "--eval.k=3", "--engine.options={x: planted-1}"],
                       secrets={"planted-1"}) == [  # fmt: skip
        "agl", "eval", "--sidecar.admin_token", REDACTED, f"--harness.env.K={REDACTED}", f"--api-key={REDACTED}",
        "--model-url", f"http://{REDACTED}@h/v1", "--eval.k=3", f"--engine.options={{x: {REDACTED}}}",
    ]
    assert redact_argv(["agl-sidecar", "--no-api-key", "--listen", "0.0.0.0:1"]) == [
        "agl-sidecar", "--no-api-key", "--listen", "0.0.0.0:1"]  # a switch named like a key takes no value
    assert redact_text("cannot reach postgres://admin:hunter22@db/x and http://h/p@q") == (
        f"cannot reach postgres://{REDACTED}@db/x and http://h/p@q"  # an @ in a path is not userinfo
    )
