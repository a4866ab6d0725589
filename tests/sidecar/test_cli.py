"""The agl-sidecar command: help, config validation with clear errors, env and YAML, readiness."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from agl_sidecar.cli import main
from agl_sidecar.config import ConfigError, build, env_values, is_loopback, load_yaml
from tests.support.waiting import wait_until


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--upstream", "--listen", "--otlp-endpoint", "--config", "--admin-token", "--api-key",
                 "--max-hold-s", "--spool-dir", "AGL_SIDECAR_"):
        assert flag in text


@pytest.mark.parametrize(
    ("layers", "fragment"),
    [
        ({}, "no upstream"),
        ({"upstream": ["localhost:8000"]}, "must start with http://"),
        ({"upstream": ["http://a"], "listen": "nowhere"}, "HOST:PORT"),
        ({"upstream": ["http://a"], "max_hold_s": "soon"}, "'max_hold_s'"),
        ({"upstream": ["http://a"], "sampling": {"warmup": {"temperature": 1}}}, "mode 'warmup'"),
        ({"upstream": ["http://a"], "colour": "blue"}, "unknown setting 'colour'"),
        ({"upstream": ["http://a"], "otlp_endpoint": "collector:4318"}, "'otlp_endpoint'"),
        ({"upstream": ["http://a"], "token_cache_bytes": -1}, "'token_cache_bytes' must be >= 0"),
    ],
)
def test_bad_config_names_key_and_fix(layers, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build(layers)


def test_precedence_file_env_flags(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text("upstream: [http://file:1]\nmax-hold-s: 5\nsampling: {train: {temperature: 1.0}}\n")
    env = env_values({"AGL_SIDECAR_MAX_HOLD_S": "7", "AGL_SIDECAR_UPSTREAM": "http://env:1,http://env:2"})
    config = build(load_yaml(str(path)), env, {"listen": "127.0.0.1:9999"})
    assert config.upstream == ["http://env:1", "http://env:2"] and config.max_hold_s == 7.0
    assert config.sampling == {"train": {"temperature": 1.0}} and config.host_port == ("127.0.0.1", 9999)


def test_cli_reports_config_errors_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "agl_sidecar.cli", "--upstream", "nope"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "AGL_SIDECAR_CONFIG": ""},
    )
    assert result.returncode == 2
    assert "must start with http://" in result.stderr and "Traceback" not in result.stderr


def test_cli_starts_prints_ready_line_and_never_imports_litellm(fake, tmp_path):
    code = (
        "import sys, runpy; sys.argv = ['agl-sidecar', '--upstream', %r, '--listen', '127.0.0.1:0', "
        "'--spool-dir', %r];\n"
        "import agl_sidecar.server as s\n"
        "orig = s.serve_forever\n"
        "def wrapped(config, on_ready):\n"
        "    def ready(url):\n"
        "        on_ready(url); print('litellm loaded:', 'litellm' in sys.modules, 'torch loaded:', 'torch' in sys.modules, flush=True)\n"
        "    orig(config, ready)\n"
        "s.serve_forever = wrapped\n"
        "from agl_sidecar.cli import main; sys.exit(main())\n"
    ) % (fake.base_url, str(tmp_path / "spool"))
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = process.stdout.readline()
        assert ready.startswith("agl-sidecar listening on http://127.0.0.1:"), process.stderr.read()
        url = ready.split()[-1]
        assert process.stdout.readline().strip() == "litellm loaded: False torch loaded: False"
        wait_until(lambda: httpx.get(url + "/healthz").status_code == 200, "/healthz answering 200", timeout=10)
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("::1%lo", True),
     ("0.0.0.0", False), ("10.0.0.5", False), ("127.0.0.1.example", False), ("", False)],
)
def test_one_loopback_rule_for_listen_admin_callers_and_export(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_export_compression_auto_gzips_only_repeats_on_loopback():
    base = {"upstream": ["http://a"]}
    assert build({**base, "otlp_endpoint": "http://127.0.0.1:4318"}).compress_export == "repeats"
    assert build({**base, "otlp_endpoint": "http://[::1]:4318"}).compress_export == "repeats"
    assert build({**base, "otlp_endpoint": "http://collector.internal:4318"}).compress_export is True
    assert build({**base, "otlp_endpoint": "http://127.0.0.1:4318", "otlp_compression": "gzip"}).compress_export is True
    assert build({**base, "otlp_endpoint": "http://collector:4318", "otlp_compression": "none"}).compress_export is False
    with pytest.raises(ConfigError, match="otlp_compression"):
        build({**base, "otlp_compression": "zstd"})
