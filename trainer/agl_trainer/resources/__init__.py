"""Resource arithmetic before a run: model size from its directory, memory per GPU (`agl train --dry-run`)."""

from agl_trainer.resources.architecture import (
    Architecture,
    ArchitectureError,
    architecture_from_dict,
    read_architecture,
    safetensors_parameters,
)
from agl_trainer.resources.plan import ResourcePlan, format_plan, plan_resources

__all__ = [
    "Architecture",
    "ArchitectureError",
    "ResourcePlan",
    "architecture_from_dict",
    "format_plan",
    "plan_resources",
    "read_architecture",
    "safetensors_parameters",
]
