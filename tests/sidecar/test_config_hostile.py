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
        # otlp_headers go out on every export request: a value aiohttp refuses killed each export cycle
        # with its batch in flight; a name that is not an HTTP token dead-lettered every span.
        ({"otlp_headers": {"authorization": "Bearer t\r\nX-Evil: 1"}}, "'otlp_headers' value of 'authorization'"),
        ({"otlp_headers": {"authorization": "Bearer t\n"}}, "line breaks or control characters"),
        ({"otlp_headers": {"x-tenant": "a\x00b"}}, "'otlp_headers' value of 'x-tenant'"),
        ({"otlp_headers": {"x-tenant": "caf\u00e9"}}, "printable ASCII"),
        ({"otlp_headers": {"x tenant": "a"}}, "'otlp_headers' name 'x tenant' is not an HTTP header name"),
        ({"otlp_headers": {"": "a"}}, "'otlp_headers' name '' is not an HTTP header name"),
        ({"otlp_headers": {"x:y": "a"}}, "not an HTTP header name"),
        ({"otlp_headers": {"x-\u00e9": "a"}}, "not an HTTP header name"),
        ({"otlp_protocol": "grpc", "otlp_headers": {"x!y": "a"}}, "gRPC metadata"),
        ({"otlp_protocol": "grpc", "otlp_headers": {"x-bin": "a"}}, "gRPC metadata"),
        # An upstream no call can reach: every call was a 500 (a name IDNA cannot encode) or went to port 80.
        ({"upstream": ["http://gpu1..cluster:8000"]}, "'upstream': upstream 'http://gpu1..cluster:8000' has a host name"),
        ({"upstream": ["http://" + "a" * 64 + ".example:8000"]}, "has a host name that is not valid"),
        ({"upstream": ["http://xn--zz.example:8000"]}, "has a host name that is not valid"),
        ({"upstream": ["http://gpu 1:8000"]}, "has a host name that is not valid"),
        ({"upstream": ["http://\udcff:8000"]}, "has a host name that is not valid"),
        ({"upstream": ["http://127.0.0.1:0"]}, "port 0"),
        ({"upstream": ["http://u:pw@gpu1:0/v1"]}, "'upstream': upstream 'http://gpu1:0/v1' has port 0"),
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


@pytest.mark.parametrize("url", ["http://gpu1:8000", "http://gpu-1.cluster.local.:8000", "http://my_engine:8000",
                                 "http://b\u00fccher.example:8000", "http://[::1]:8000", "https://10.0.0.1/v1"])
def test_ordinary_upstream_names_still_start(url):
    assert build({"upstream": [url]}).upstream == [url]


def test_ordinary_otlp_headers_still_start():
    headers = {"authorization": "Bearer abc.DEF-123_~+/=", "X-Scope-OrgID": "team a", "x!#$%&'*+.^_`|~": "v\tw"}
    assert build({**UPSTREAM, "otlp_headers": headers}).otlp_headers == headers
    grpc = {"authorization": "Bearer abc", "X-Scope-OrgID": "a"}
    assert build({**UPSTREAM, "otlp_protocol": "grpc", "otlp_headers": grpc}).otlp_headers == grpc


def test_finite_values_still_start():
    config = build({**UPSTREAM, "max_hold_s": 5, "upstream_timeout_s": 30, "sampling": {"train": {"temperature": 0.7}}})
    assert config.max_hold_s == 5 and config.upstream_timeout_s == 30


def test_a_config_file_reads_yaml_1_2_booleans(tmp_path):
    """Only true/false are booleans (YAML 1.2): `yes`, `off` in a string setting stay strings. Before,
    PyYAML's YAML 1.1 read them as booleans: a header `x-debug: yes` refused the sidecar with "Expected
    `str`, got `bool`", and `otlp_compression: off` named a bool where the user wrote 'off'."""
    path = tmp_path / "sidecar.yaml"
    path.write_text("upstream: [http://127.0.0.1:1]\notlp_headers: {x-debug: yes, x-trace: On}\nno-api-key: True\n")
    config = build(load_yaml(str(path)))
    assert config.otlp_headers == {"x-debug": "yes", "x-trace": "On"}
    assert config.no_api_key is True
    path.write_text("upstream: [http://127.0.0.1:1]\notlp_compression: off\n")
    with pytest.raises(ConfigError, match="'off' must be gzip, none or auto"):
        build(load_yaml(str(path)))
