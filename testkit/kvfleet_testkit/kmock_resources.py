"""KMock's Kubernetes API emulator with the resources kvfleet's components use registered: the
InferenceDeployment custom resource beside KMock's built-in ones (without the built-ins, kopf's
discovery finds nothing and the operator silently never lists or watches)."""

from __future__ import annotations

from collections.abc import Iterable

import kmock

from kvfleet.spec import GROUP, KIND, PLURAL, SINGULAR, VERSION

INFERENCE_DEPLOYMENTS = f"{GROUP}/{VERSION}/{PLURAL}"
VERBS = frozenset({"get", "list", "watch", "create", "patch", "update", "delete"})


def register_inference_deployments(
    emulator: kmock.KubernetesEmulator, subresources: Iterable[str] = ("status",)
) -> None:
    """Load KMock's built-in resources into ``emulator`` and register InferenceDeployments with
    ``subresources`` (the CRD has ``status`` and ``scale``)."""
    emulator.resources.load_bundled()
    emulator.resources[INFERENCE_DEPLOYMENTS] = kmock.ResourceInfo(
        kind=KIND, singular=SINGULAR, namespaced=True, verbs=set(VERBS), subresources=set(subresources)
    )
