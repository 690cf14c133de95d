"""What the API server knows the InferenceDeployment resource as: group, version, kind, plural,
short names, and the bound on ``metadata.name`` that keeps every child's name a valid label.

Kept apart from the models so the CRD generator, the operator's registration and the clients that
build API paths import the names without the schema."""

from __future__ import annotations

from kvfleet.contracts import API_GROUP

GROUP = API_GROUP
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]

# Child objects are named "<name>-engine", "<name>-engine-pdb", ...; the longest suffix the
# operator adds is 11 characters, and Service names must be DNS-1035 labels of <= 63.
MAX_NAME_CHARS = 52
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
