"""The operator's names for child objects and pod paths.

What another component reads (labels the router selects on, child names, the files the launcher
reads) is defined in ``kvfleet.contracts`` and named here so the operator's modules have one place
to look; what only the operator uses is defined here.
"""

from __future__ import annotations

from kvfleet.contracts import (
    APP_NAME_LABEL,
    ARTIFACT_KEYS_FILE,
    DEPLOYMENT_LABEL,
    ENGINE_APP,
    NODE_CACHE_MOUNT,
    PIN_KEY,
    PIN_MOUNT_DIR,
    SPEC_FILE,
    SPEC_HASH_ANNOTATION,
    SPEC_MOUNT_DIR,
    engine_name,
    kv_events_replay_port,
    pdb_name,
    pin_configmap_name,
    spec_configmap_name,
)
from kvfleet.contracts import ENGINE_HTTP_PORT_NAME as HTTP_PORT
from kvfleet.contracts import KV_EVENTS_PORT_NAME as KV_EVENTS_PORT
from kvfleet.contracts import KV_EVENTS_REPLAY_PORT_NAME as KV_EVENTS_REPLAY_PORT
from kvfleet.contracts import LAUNCHER_PORT_NAME as LAUNCHER_PORT
from kvfleet.contracts import engine_labels as labels

# The contracts' names the operator's modules use as ``names.X``.
__all__ = [
    "ARTIFACTS_WORK_MOUNT",
    "ARTIFACT_KEYS_FILE",
    "DEPLOYMENT_LABEL",
    "HTTP_PORT",
    "KV_EVENTS_PORT",
    "KV_EVENTS_REPLAY_PORT",
    "LAUNCHER_PORT",
    "NODE_CACHE_MOUNT",
    "PIN_KEY",
    "PIN_MODEL_KEY",
    "PIN_MOUNT_DIR",
    "SHM_MOUNT",
    "SPEC_FILE",
    "SPEC_HASH_ANNOTATION",
    "SPEC_MOUNT_DIR",
    "engine_name",
    "kv_events_replay_port",
    "labels",
    "pdb_name",
    "pin_configmap_name",
    "selector",
    "selector_string",
    "spec_configmap_name",
]

# The pod's own emptyDir where the launcher unpacks checked artifacts (no other pod can write it);
# the launcher learns it from $KVFLEET_ARTIFACTS_WORK.
ARTIFACTS_WORK_MOUNT = "/var/lib/kvfleet/artifacts-work"
# The source the pin belongs to, kept beside the digest so a changed model drops the pin; only the
# operator reads it back.
PIN_MODEL_KEY = "model"
SHM_MOUNT = "/dev/shm"  # noqa: S108  (a mount point in the pod, not a temp file here)


def selector(name: str) -> dict[str, str]:
    """The Deployment's selector: immutable, so only labels that never change for a name."""
    return {APP_NAME_LABEL: ENGINE_APP, DEPLOYMENT_LABEL: name}


def selector_string(name: str) -> str:
    """The selector as a label-selector string (status.selector, the scale subresource, list calls)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector(name).items()))
