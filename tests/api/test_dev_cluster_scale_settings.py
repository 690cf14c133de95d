"""The dev cluster's settings for large runs (bench/scale.py): an audit log limited to chosen user
groups, and the bound on kwok nodes (pure: nothing is started)."""

from __future__ import annotations

import pytest

from kvfleet.devcluster.commands import AUDIT_POLICY, audit_policy
from kvfleet.devcluster.nodes import MAX_GPU_NODES, gpu_nodes


def test_audit_policy_records_everyone_unless_groups_are_named() -> None:
    assert audit_policy(()) == AUDIT_POLICY
    limited = audit_policy(("system:serviceaccounts:kvfleet-system",))
    rules = limited["rules"]
    assert isinstance(rules, list)
    # The first matching rule decides: the named groups at Metadata, every other request not at all.
    assert rules == [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts:kvfleet-system"]},
        {"level": "None"},
    ]
    assert limited["omitStages"] == AUDIT_POLICY["omitStages"]


def test_gpu_nodes_are_bounded() -> None:
    nodes = gpu_nodes(200, gpus=16, product="NVIDIA-H100-80GB-HBM3")
    assert len({n["metadata"]["name"] for n in nodes}) == 200
    assert nodes[0]["status"]["allocatable"]["nvidia.com/gpu"] == "16"
    with pytest.raises(ValueError, match=f"1..{MAX_GPU_NODES}"):
        gpu_nodes(MAX_GPU_NODES + 1, gpus=8, product="x")
