"""Headless Chromium driven through its own command line (--dump-dom, --screenshot): no Python
dependency. `chromium()` is the executable, or None with the reason it cannot run here."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium() -> tuple[str | None, str]:
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found, ""
    return None, "no Chromium here (make test installs Debian's `chromium` when it runs as root with apt-get)"


def run(executable: str, url: str, *args: str, budget_ms: int = 8000, timeout_s: float = 90) -> str:
    """Load `url`, let the page's script run (virtual time waits for its fetches), return stdout."""
    with tempfile.TemporaryDirectory(prefix="agl-chromium-") as profile:
        done = subprocess.run(
            [executable, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *args, url],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(executable: str, url: str, expect: str, tries: int = 3) -> str:
    """The rendered DOM once it holds `expect` (a loaded machine can need a second load)."""
    dom = ""
    for _ in range(tries):
        dom = run(executable, url, "--dump-dom")
        if expect in dom:
            return dom
    return dom


def screenshot(executable: str, url: str, path: Path, size: str = "1300,1400") -> Path:
    run(executable, url, f"--screenshot={path}", f"--window-size={size}")
    return path
