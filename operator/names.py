"""Names and labels of child objects (docs/contracts.md pins them; the router and Prometheus select on them)."""

from __future__ import annotations

from kvfleet.spec import GROUP

DEPLOYMENT_LABEL = f"{GROUP}/deployment"
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"
MANAGED_BY = "kvfleet-operator"
ENGINE_APP = "kvfleet-engine"
# The engine pod's KV-cache events port name; the routers look it up in the EndpointSlices.
KV_EVENTS_PORT = "kv-events"

SPEC_MOUNT_DIR = "/etc/kvfleet"
SPEC_FILE = "spec.json"
# Beside spec.json: the public keys whose artifact signatures the launcher accepts (its default path).
ARTIFACT_KEYS_FILE = "artifact-keys.pem"
# The pod's own emptyDir where the launcher unpacks checked artifacts (no other pod can write it).
ARTIFACTS_WORK_MOUNT = "/var/lib/kvfleet/artifacts-work"
NODE_CACHE_MOUNT = "/var/cache/kvfleet"
# The pinned model digest: one file, PIN_KEY, in its own ConfigMap volume (the launcher's default).
# Beside the spec's mount, not inside it: a mount point inside a ConfigMap volume is not portable.
PIN_MOUNT_DIR = "/etc/kvfleet-pin"
PIN_KEY = "modelDigest"
PIN_MODEL_KEY = "model"
SHM_MOUNT = "/dev/shm"  # noqa: S108  (a mount point in the pod, not a temp file here)


def engine_name(name: str) -> str:
    """Deployment and Service."""
    return f"{name}-engine"


def spec_configmap_name(name: str) -> str:
    return f"{name}-engine-spec"


def pin_configmap_name(name: str) -> str:
    return f"{name}-engine-pin"


def pdb_name(name: str) -> str:
    return f"{name}-engine-pdb"


def labels(name: str) -> dict[str, str]:
    """Labels of the engine pods and of every child."""
    return {
        "app.kubernetes.io/name": ENGINE_APP,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        DEPLOYMENT_LABEL: name,
    }


def selector(name: str) -> dict[str, str]:
    """The Deployment's selector: immutable, so only labels that never change for a name."""
    return {"app.kubernetes.io/name": ENGINE_APP, DEPLOYMENT_LABEL: name}


def selector_string(name: str) -> str:
    """The selector as a label-selector string (status.selector, the scale subresource, list calls)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector(name).items()))
