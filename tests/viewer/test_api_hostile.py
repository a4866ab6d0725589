"""The viewer against requests its HTTP parser refuses: a 400, logged as the client's fault."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request


def test_an_over_long_url_is_a_400_and_a_warning_not_a_traceback(server, caplog):
    # Before: aiohttp logged it as an ERROR with a traceback ("Error handling request").
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        try:
            urllib.request.urlopen(server.url + "api/rollouts?task=" + "a" * 10000, timeout=30)
            status = 200
        except urllib.error.HTTPError as error:
            status = error.code
    assert status == 400
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
