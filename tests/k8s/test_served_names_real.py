"""Two namespaces claim one served name on a real API server: the operator refuses the newer
claimant (creationTimestamp as the API server sets it) with Ready=False, reason ServedNameConflict,
a Warning Event and no pods, and lets it take the name by itself once the older one is deleted."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.real_cluster import ComponentProcess, Kubectl, condition, wait_for

REPO = Path(__file__).resolve().parents[2]


def tiny(namespace: str) -> dict[str, Any]:
    doc = next(d for d in yaml.safe_load_all((REPO / "examples" / "tiny.yaml").read_text()) if d)
    doc["metadata"] = {"name": "tiny", "namespace": namespace}
    doc["spec"]["model"]["servedName"] = "shared-name"
    return dict(doc)


@pytest.fixture
def older_namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def test_newer_claimant_is_refused_and_takes_the_name_once_it_is_free(
    kubectl: Kubectl,
    start_operator: Callable[..., ComponentProcess],
    older_namespace: str,
    namespace: str,
) -> None:
    start_operator("--namespace", older_namespace, "--namespace", namespace, "--rollout-check-interval-s", "1")
    kubectl.apply(tiny(older_namespace))
    wait_for(lambda: kubectl.get("deployment", "tiny-engine", older_namespace), 60, "the older claimant's Deployment")
    time.sleep(1.1)  # creationTimestamp has one-second resolution: the newer one is a second younger
    kubectl.apply(tiny(namespace))
    created = kubectl.get("infd", "tiny", older_namespace)["metadata"]["creationTimestamp"]
    ready = wait_for(
        lambda: (
            (c := condition(kubectl.get("infd", "tiny", namespace), "Ready"))
            and c["reason"] == "ServedNameConflict"
            and c
        ),
        60,
        "Ready=False ServedNameConflict",
    )
    assert ready["status"] == "False"
    assert ready["message"] == f'served name "shared-name" is already served by {older_namespace}/tiny since {created}'
    events = wait_for(
        lambda: kubectl.json("get", "events", "-n", namespace, "--field-selector", "reason=ServedNameConflict")[
            "items"
        ],
        30,
        "a ServedNameConflict Event",
    )
    assert events[0]["type"] == "Warning" and f"{older_namespace}/tiny" in events[0]["message"]
    time.sleep(3)
    assert kubectl.get("deployment", "tiny-engine", namespace) is None

    kubectl("delete", "infd", "tiny", "-n", older_namespace, "--timeout=60s")
    gone = time.monotonic()
    wait_for(lambda: kubectl.get("deployment", "tiny-engine", namespace), 30, "the newer claimant's Deployment")
    took_s = time.monotonic() - gone
    print(f"the newer claimant got its Deployment {took_s:.1f} s after the older one was deleted")
    assert (condition(kubectl.get("infd", "tiny", namespace), "Degraded") or {}).get("reason") != "ServedNameConflict"
