"""``Ref``: a resource type's address (apiVersion and URL plural) and the paths it gives (pure), and the
one for kvfleet's own InferenceDeployments."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.spec.identity import API_VERSION, PLURAL


def group_path(api_version: str) -> str:
    """``/api/v1`` for the core group, ``/apis/<group>/<version>`` for every other."""
    return f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"


@dataclass(frozen=True)
class Ref:
    """Addresses one resource type: apiVersion ("v1", "apps/v1") and the URL plural."""

    api_version: str
    plural: str

    def collection(self, namespace: str | None) -> str:
        base = group_path(self.api_version)
        return f"{base}/namespaces/{namespace}/{self.plural}" if namespace else f"{base}/{self.plural}"

    def item(self, namespace: str | None, name: str, subresource: str | None = None) -> str:
        path = f"{self.collection(namespace)}/{name}"
        return f"{path}/{subresource}" if subresource else path


INFERENCE_DEPLOYMENTS = Ref(API_VERSION, PLURAL)
"""kvfleet's own resource, as the operator, the router and the autoscaler address it."""
