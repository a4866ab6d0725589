"""The admin API against values a caller may get wrong: each is a 400 naming the value, never a 500,
and a refused resume changes nothing."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("url", ["http://[::1", "http://user:secret@[::1:8000", "https://[fe80::1%25eth0"])
def test_resume_with_an_upstream_url_python_cannot_split_is_a_400_naming_it(fake, make_sidecar, url):
    # Before: urlsplit's ValueError ("Invalid IPv6 URL") escaped the route: a 500 and a traceback.
    sidecar = make_sidecar(upstream=[fake.base_url])
    answer = httpx.post(sidecar.url + "/agl/v1/resume", json={"upstreams": [fake.base_url, url]})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "not a valid URL" in error and "secret" not in error
    assert httpx.get(sidecar.url + "/agl/v1/state").json()["upstreams"] == [fake.base_url]  # unchanged
