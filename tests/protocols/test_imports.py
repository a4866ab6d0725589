"""The adapters and integrations load their heavy dependencies only when used: a sidecar that
serves only chat must start without litellm (about 3 s to import)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("litellm", "torch", "anthropic", "openai", "agents", "langchain_openai", "minisweagent")


def modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_importing_the_adapters_loads_no_litellm() -> None:
    loaded = modules_after("import agl_sidecar.protocols.anthropic, agl_sidecar.protocols.responses")
    assert not loaded & set(HEAVY)


def test_importing_the_integrations_loads_no_framework() -> None:
    loaded = modules_after(
        "import agl_integrations, agl_integrations.anthropic_sdk, agl_integrations.openai_agents, "
        "agl_integrations.langchain, agl_integrations.mini_swe_agent"
    )
    assert not loaded & set(HEAVY)
