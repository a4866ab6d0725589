"""Sidecar settings a YAML file can spell but the sidecar cannot use: refused at start, naming the
setting, never a traceback or a sidecar that starts with them."""

from __future__ import annotations

import pytest

from agl_sidecar.config import ConfigError, build, load_yaml

UPSTREAM = {"upstream": ["http://127.0.0.1:1"]}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_hold_s": float("nan")}, "'max_hold_s' must be a number of seconds > 0"),  # YAML .nan: started
        ({"max_hold_s": float("inf")}, "'max_hold_s' must be a number of seconds > 0"),
        ({"export_interval_s": float("nan")}, "'export_interval_s'"),
        ({"upstream_timeout_s": -1.0}, "'upstream_timeout_s' must be a number of seconds > 0"),  # was unchecked
        ({"sampling": {"train": {"temperature": float("nan")}}}, "'sampling.train.temperature': nan must be a finite"),
        ({"sampling": {"val": {"top_p": float("inf")}}}, "'sampling.val.top_p': inf must be a finite"),
        ({"upstream_api_key": "k\r\nX-Evil: 1"}, "'upstream_api_key' must be printable ASCII"),  # a header
        ({"upstream_api_key": "kéy"}, "'upstream_api_key' must be printable ASCII"),
    ],
)
def test_non_finite_and_negative_durations_and_sampling_values_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        build({**UPSTREAM, **settings})


def test_yaml_specials_from_a_file_are_refused_by_name(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text("upstream: [http://127.0.0.1:1]\nmax-hold-s: .nan\n")
    with pytest.raises(ConfigError, match="'max_hold_s'"):
        build(load_yaml(str(path)))


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    # Before: UnicodeDecodeError escaped load_yaml (a traceback from agl-sidecar --config).
    path = tmp_path / "sidecar.yaml"
    path.write_bytes(b"upstream: [http://127.0.0.1:1]\n\xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_yaml(str(path))


def test_finite_values_still_start():
    config = build({**UPSTREAM, "max_hold_s": 5, "upstream_timeout_s": 30, "sampling": {"train": {"temperature": 0.7}}})
    assert config.max_hold_s == 5 and config.upstream_timeout_s == 30
