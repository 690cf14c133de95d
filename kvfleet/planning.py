"""``kvfleet plan``: what the operator would create for a deployment.

Until the operator's renderers land this shows the deployment with every default filled in,
which is what the operator reconciles from.
"""

from __future__ import annotations

from typing import Any

from kvfleet.resource import InferenceDeployment


def plan_children(deployment: InferenceDeployment) -> list[dict[str, Any]]:
    """The objects the operator would apply for ``deployment``, as plain dicts."""
    return [
        {
            "apiVersion": deployment.api_version,
            "kind": deployment.kind,
            "metadata": {"name": deployment.name, "namespace": deployment.namespace},
            "spec": deployment.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
    ]
