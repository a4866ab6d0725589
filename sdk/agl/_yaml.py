"""agl's config files read as YAML 1.2 reads booleans: only true/false (any case) are booleans, so
`otlp_compression: off` or `importance_scope: off` is the string 'off', not False (PyYAML implements
YAML 1.1, which also reads yes/no/on/off/y/n as booleans). Shared by the sidecar's and the trainer's
config loaders; PyYAML is imported on first use, never by `import agl`."""

from __future__ import annotations

import functools
import re
from typing import Any

YAML12_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


@functools.cache
def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", YAML12_BOOL, list("tTfF"))
    return Loader


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)` with YAML 1.2's booleans; raises yaml.YAMLError as safe_load does."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
