"""Who may read the viewer: Host names on loopback (DNS rebinding), a token off loopback (the same
rule as `agl receive`), over real HTTP."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from agl_trainer.cli import main
from agl_trainer.viewer import Viewer, ViewerServer
from agl_trainer.viewer.access import AccessError
from agl_trainer.viewer.training import start_for_training

from tests.viewer.conftest import start


def request(server: ViewerServer, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port_of(server))
    connection.request("GET", path, headers=headers or {})
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def port_of(server: ViewerServer) -> int:
    return int(server.url.rstrip("/").rsplit(":", 1)[1])


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1.evil.example", "127.0.0.1.evil.example:{port}", "127.evil.example", "127.1", "localhost.evil.example",
     "evil.example", "[::1].evil.example", "[::2]:{port}", "::1", "127.0.0.1:{port}:1", "127.0.0.1:99999",
     "0x7f.0.0.1", "[::ffff:127.0.0.1]", ""],
)  # fmt: skip
def test_a_host_that_only_looks_like_loopback_is_refused(server: ViewerServer, host: str) -> None:
    # Before: any Host starting with "127." was served (a rebinding page on 127.0.0.1.evil.example).
    port = port_of(server)
    response = request(server, "/api/overview", {"Host": host.format(port=port)})
    assert response.status == 403, host


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "127.0.0.1", "127.9.8.7:{port}", "localhost:{port}",
                                  "LocalHost", "[::1]:{port}", "[::1]"])  # fmt: skip
def test_loopback_hosts_with_or_without_a_port_are_served(server: ViewerServer, host: str) -> None:
    response = request(server, "/api/overview", {"Host": host.format(port=port_of(server))})
    assert response.status == 200, host


def test_off_loopback_without_a_token_the_viewer_does_not_start(built: tuple[Path, Path], capsys) -> None:
    store, _ = built
    with pytest.raises(AccessError, match="off loopback, without a token"):
        ViewerServer(Viewer(store, index=False), "0.0.0.0:0")
    assert main(["traces", "serve", "--store", str(store), "--listen", "0.0.0.0:0"]) == 2
    error = capsys.readouterr().err
    assert "without a token" in error and "AGL_VIEWER_TOKEN" in error and "--no-token" in error


def test_the_training_viewer_follows_the_same_rule(built: tuple[Path, Path], tmp_path: Path, capsys, monkeypatch) -> None:
    store, _ = built
    monkeypatch.delenv("AGL_VIEWER_TOKEN", raising=False)
    assert start_for_training(store, "0.0.0.0:0", None, tmp_path) is None
    assert "without a token" in capsys.readouterr().err
    monkeypatch.setenv("AGL_VIEWER_TOKEN", "s3cret-token")
    server = start_for_training(store, "127.0.0.1:0", None, tmp_path)
    assert server is not None
    try:
        assert request(server, "/api/overview").status == 401
        assert request(server, "/api/overview", {"Authorization": "Bearer s3cret-token"}).status == 200
    finally:
        server.stop()


def test_with_a_token_every_request_needs_it_by_header_or_cookie(built: tuple[Path, Path]) -> None:
    store, _ = built
    with start(store, token="s3cret-token") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"},
                        {"Cookie": "agl_viewer_token=wrong"}):  # fmt: skip
            for path in ("/", "/api/overview", "/static/app.js", "/api/rollouts"):
                response = request(server, path, headers)
                assert response.status == 401, (path, headers)
        connection = http.client.HTTPConnection("127.0.0.1", port_of(server))
        connection.request("GET", "/api/rollouts")
        denied = connection.getresponse()
        assert "Bearer" in json.loads(denied.read())["error"]
        assert request(server, "/api/rollouts", {"Authorization": "Bearer s3cret-token"}).status == 200
        # a browser: the first visit with ?token= sets a cookie and drops the token from the URL
        first = request(server, "/?token=s3cret-token&x=1#", {})
        assert first.status == 303 and first.headers["Location"] == "/?x=1"
        cookie = first.headers["Set-Cookie"]
        assert "agl_viewer_token=s3cret-token" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert request(server, "/?token=wrong").status == 401
        jar = {"Cookie": "agl_viewer_token=s3cret-token"}
        assert request(server, "/", jar).status == 200
        assert request(server, "/api/overview", jar).status == 200
        # the token does not open the Host check: a rebinding page with the cookie is still refused
        assert request(server, "/api/overview", {**jar, "Host": "127.0.0.1.evil.example"}).status == 403
