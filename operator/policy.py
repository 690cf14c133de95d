"""The platform team's policy on what an InferenceDeployment spec may ask for, as a pure decision.

A spec becomes a pod that the operator creates with its own cluster-wide rights, so the fields that
reach the node or the scheduler are limited here: node-cache host paths, engine images (by
registry), PriorityClasses and tolerated taints. The chart renders the same lists into a
ValidatingAdmissionPolicy (templates/spec-policy.yaml), so `kubectl apply` is refused first; the
operator checks again because that policy can be turned off or not yet be installed, and an
operator that trusted admission alone would create whatever got past it.

Each list holds what is allowed; ``"*"`` in a list allows anything for that field. An empty list
allows nothing beyond the default (emptyDir, the operator's own images, no PriorityClass, no
toleration).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic.alias_generators import to_camel

from kvfleet.spec import InferenceDeploymentSpec

ANY = "*"

HostPath = Annotated[str, StringConstraints(pattern=r"^(\*|/.*)$", max_length=1024)]
Registry = Annotated[str, StringConstraints(pattern=r"^(\*|[^\s/][^\s]*)$", max_length=512)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=316)]


class SpecPolicy(BaseModel):
    """What a spec may ask for; the wire form (camelCase) is the chart's `policy` values. Every list is
    required: a file that left one out would otherwise mean "anything" or "nothing" by accident."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)

    node_cache_host_paths: tuple[HostPath, ...] = Field(
        max_length=64,
        description="Node directories a hostPath node cache may use (the directory or below it); empty: emptyDir only.",
    )
    image_registries: tuple[Registry, ...] = Field(
        max_length=64,
        description="Registry prefixes engine.image may come from (e.g. ghcr.io/kvfleet: that repository "
        "path and below); a spec without engine.image runs the operator's own image and always passes.",
    )
    priority_classes: tuple[Name, ...] = Field(
        max_length=64, description="PriorityClass names scheduling.priorityClassName may name."
    )
    toleration_keys: tuple[Name, ...] = Field(
        max_length=64,
        description="Taint keys scheduling.tolerations may tolerate; a toleration without a key tolerates "
        "every taint and passes only with '*'.",
    )

    @field_validator("node_cache_host_paths")
    @classmethod
    def _no_dotdot(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if ".." in path.split("/"):
                raise ValueError(f"{path!r} must not contain '..' path segments")
        return value


# The standalone operator's default: no restriction (its behaviour before a policy existed). The
# chart always passes a policy file, with a restrictive default.
UNRESTRICTED = SpecPolicy(
    node_cache_host_paths=(ANY,), image_registries=(ANY,), priority_classes=(ANY,), toleration_keys=(ANY,)
)


def load_policy(path: Path) -> SpecPolicy:
    """Read the policy file the chart mounts (YAML or JSON); a bad file fails the operator's start."""
    data = yaml.safe_load(path.read_text()) or {}
    return SpecPolicy.model_validate(data)


@dataclass(frozen=True)
class Violation:
    """One field a spec may not have under the policy."""

    field: str  # spec.cache.nodeCache.hostPath
    policy: str  # nodeCacheHostPaths
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _allowed(listed: tuple[str, ...]) -> str:
    return ", ".join(listed) if listed else "none"


def _under(path: str, directory: str) -> bool:
    directory = directory.rstrip("/")
    return path == directory or path.startswith(directory + "/") or directory == ""


def host_path_allowed(path: str, policy: SpecPolicy) -> bool:
    return any(entry == ANY or _under(path, entry) for entry in policy.node_cache_host_paths)


def host_path_root(path: str, policy: SpecPolicy) -> str:
    """The platform's directory a hostPath node cache lives under: the outermost allowed entry that
    holds ``path`` (entries may nest). With ``"*"`` and no listed entry holding it, the path itself:
    the platform then allows any directory, and separation is only as good as that choice."""
    roots = [entry.rstrip("/") or "/" for entry in policy.node_cache_host_paths if entry != ANY]
    holding = sorted((root for root in roots if _under(path, root)), key=len)
    return holding[0] if holding else path.rstrip("/") or "/"


def image_allowed(image: str, policy: SpecPolicy) -> bool:
    # A boundary at "/": ghcr.io/kvfleet must not admit ghcr.io/kvfleet-evil/x or ghcr.io.evil.com/x.
    return any(entry == ANY or image.startswith(entry.rstrip("/") + "/") for entry in policy.image_registries)


def violations(spec: InferenceDeploymentSpec, policy: SpecPolicy) -> list[Violation]:
    """Every field of ``spec`` the policy refuses, in spec order; empty when it may run."""
    found: list[Violation] = []
    host_path = spec.cache.node_cache.host_path
    if spec.cache.node_cache.type == "hostPath" and host_path is not None and not host_path_allowed(host_path, policy):
        found.append(
            Violation(
                "spec.cache.nodeCache.hostPath",
                "nodeCacheHostPaths",
                f"host path {host_path} is not allowed by the platform policy nodeCacheHostPaths "
                f"(allowed: {_allowed(policy.node_cache_host_paths)}); use type emptyDir",
            )
        )
    image = spec.engine.image
    if image is not None and not image_allowed(image, policy):
        found.append(
            Violation(
                "spec.engine.image",
                "imageRegistries",
                f"image {image} is not from a registry allowed by the platform policy imageRegistries "
                f"(allowed: {_allowed(policy.image_registries)}); omit engine.image for the default image",
            )
        )
    scheduling = spec.scheduling
    priority = scheduling.priority_class_name
    if priority is not None and ANY not in policy.priority_classes and priority not in policy.priority_classes:
        found.append(
            Violation(
                "spec.scheduling.priorityClassName",
                "priorityClasses",
                f"PriorityClass {priority} is not allowed by the platform policy priorityClasses "
                f"(allowed: {_allowed(policy.priority_classes)})",
            )
        )
    if ANY not in policy.toleration_keys:
        for i, toleration in enumerate(scheduling.tolerations):
            if toleration.key is None or toleration.key not in policy.toleration_keys:
                what = f"key {toleration.key}" if toleration.key is not None else "no key (every taint)"
                found.append(
                    Violation(
                        f"spec.scheduling.tolerations[{i}].key",
                        "tolerationKeys",
                        f"a toleration with {what} is not allowed by the platform policy tolerationKeys "
                        f"(allowed: {_allowed(policy.toleration_keys)})",
                    )
                )
    return found
