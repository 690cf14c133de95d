"""bench/scale.py's floor: plain Deployments of the very pods kvfleet's engine Deployment runs, with
nothing that kvfleet's watches would take for its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from platform_scale.objects import REPLICAS, infd, plain_deployment

from kvfleet.contracts import APP_NAME_LABEL
from kvfleet.operator.render import Owner, render_deployment
from kvfleet.operator.settings import OperatorSettings
from kvfleet.spec import InferenceDeploymentSpec


def engine_of(name: str, ns: str) -> dict:
    spec = InferenceDeploymentSpec.model_validate(infd(name, ns)["spec"])
    return render_deployment(Owner(name, ns), spec, REPLICAS, OperatorSettings())


def test_the_floor_runs_the_engine_pods_under_labels_of_its_own() -> None:
    floor, engine = plain_deployment("plain-0007", "team-07"), engine_of("plain-0007", "team-07")
    pod, engine_pod = floor["spec"]["template"]["spec"], engine["spec"]["template"]["spec"]
    assert pod["containers"] == engine_pod["containers"]  # probes, volumes, security settings: all of it
    assert pod["volumes"] == engine_pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == engine_pod["terminationGracePeriodSeconds"]
    assert floor["spec"]["strategy"] == engine["spec"]["strategy"]
    assert floor["spec"]["replicas"] == REPLICAS
    labels = floor["spec"]["template"]["metadata"]["labels"]
    assert labels == {"app": "plain-0007"} == floor["spec"]["selector"]["matchLabels"]
    assert APP_NAME_LABEL not in labels  # the operator's pod watch selects on it
    assert "labels" not in floor["metadata"] and "ownerReferences" not in floor["metadata"]
    spread = pod["topologySpreadConstraints"][0]["labelSelector"]
    assert spread == {"matchLabels": {"app": "plain-0007"}}  # spreads its own pods, not an engine's


def test_the_bare_floor_is_one_container_with_its_gpu() -> None:
    bare = plain_deployment("bare-0001", "team-01", "minimal")
    (container,) = bare["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert "readinessProbe" not in container and "volumes" not in bare["spec"]["template"]["spec"]
    with pytest.raises(ValueError, match="pods must be one of"):
        plain_deployment("x", "y", "tiny")
