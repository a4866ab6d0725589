"""A path or method the sidecar does not serve: a JSON error naming it (and, for a path it serves
with another method, a 405 saying which), not aiohttp's plain-text "404: Not Found"."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize(
    "path",
    [
        "/rollouts//v1/chat/completions",  # an empty rollout id
        "/rollouts/a/attempts/-1/v1/chat/completions",
        "/rollouts/a/v1/chat/completions/",  # a trailing slash
        "/rollouts/a/modes/val/attempts/2/v1/chat/completions",  # the parts in the wrong order
    ],
)
def test_an_unknown_path_is_a_json_404_naming_it(fake, make_sidecar, path):
    sidecar = make_sidecar(upstream=[fake.base_url])
    answer = httpx.post(sidecar.url + path, json={"model": "tiny", "messages": []})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert f"no route for 'POST {path}'" in error["message"] and "/v1/chat/completions" in error["message"]


def test_a_served_path_with_another_method_is_a_json_405(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    answer = httpx.get(sidecar.url + "/rollouts/r1/v1/chat/completions")
    assert answer.status_code == 405 and answer.headers["Allow"] == "POST"
    assert "takes POST" in answer.json()["error"]["message"]
    assert httpx.get(sidecar.url + "/v1/models").status_code == 200  # routes still win over the catch-all
