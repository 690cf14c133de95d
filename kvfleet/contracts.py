"""The names, labels, ports, paths and metric names kvfleet's components agree on, in one module.

Each value here is read by one component and written by another (the operator labels the engine
Service, the router selects EndpointSlices by that label; the engines expose vLLM's metric names,
the autoscaler queries them). Defined once, a change reaches both sides in one edit, and the tests
that pin the contract (tests/api/test_contracts.py) name the components that must agree.
docs/contracts.md is the prose of this module.

It imports nothing from kvfleet: every component, the engine included, may import it.
"""

from __future__ import annotations

# --- the API group: the prefix of every kvfleet label, annotation and finalizer
API_GROUP = "kvfleet.io"

# --- model sources (kvfleet.spec validates them, kvfleet.crd renders the same pattern into the CRD)
MODEL_URI_SCHEMES = ("s3", "hf", "pvc", "file")
MODEL_URI_PATTERN = r"^(" + "|".join(MODEL_URI_SCHEMES) + r")://.+$"

# --- labels and annotations of the engine children (the operator writes them; the router selects
# EndpointSlices by DEPLOYMENT_LABEL; the dashboards group by the app.kubernetes.io ones)
DEPLOYMENT_LABEL = f"{API_GROUP}/deployment"
SPEC_HASH_ANNOTATION = f"{API_GROUP}/spec-hash"
APP_NAME_LABEL = "app.kubernetes.io/name"
APP_INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ENGINE_APP = "kvfleet-engine"
MANAGED_BY = "kvfleet-operator"


def engine_labels(name: str) -> dict[str, str]:
    """Labels of the engine pods and of every child of the InferenceDeployment ``name``."""
    return {
        APP_NAME_LABEL: ENGINE_APP,
        APP_INSTANCE_LABEL: name,
        MANAGED_BY_LABEL: MANAGED_BY,
        DEPLOYMENT_LABEL: name,
    }


# --- child names (the longest suffix, "-engine-pdb", is why kvfleet.spec.MAX_NAME_CHARS is 52)
ENGINE_SUFFIX = "-engine"


def engine_name(name: str) -> str:
    """The engine Deployment and Service (and ServiceMonitor)."""
    return f"{name}{ENGINE_SUFFIX}"


def spec_configmap_name(name: str) -> str:
    return f"{name}{ENGINE_SUFFIX}-spec"


def pin_configmap_name(name: str) -> str:
    return f"{name}{ENGINE_SUFFIX}-pin"


def pdb_name(name: str) -> str:
    return f"{name}{ENGINE_SUFFIX}-pdb"


def engine_pod_regex(name: str) -> str:
    """A regex matching the engine pods' names: the Deployment's name, then its ReplicaSet's and the
    pod's generated suffixes (exporters such as DCGM's label GPUs with their consumer's pod name).
    ``name`` must be a DNS-1035 label, which has no regex metacharacters."""
    return f"{engine_name(name)}-.*"


# --- ports of an engine pod (the operator renders them, the launcher and the engine listen on them,
# the router reads KV_EVENTS_PORT_NAME from the EndpointSlices)
ENGINE_HTTP_PORT = 8000
ENGINE_HTTP_PORT_NAME = "http"
LAUNCHER_PORT = 9400
LAUNCHER_PORT_NAME = "launcher"
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_NAME = "kv-events"
# The launcher serves these files of the model it launched at LAUNCHER_TOKENIZER_PATH + name (and no
# others), so a router tokenizes prompts as the engine does without a mounted copy (docs/engine_image.md).
LAUNCHER_TOKENIZER_PATH = "/tokenizer/"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_MAX_BYTES = 64 * 1024 * 1024  # a large vocabulary's tokenizer.json is ~10-30 MB
# The events' replay socket (vLLM's replay_endpoint, a ZeroMQ ROUTER) listens on the events port + 1
# (vLLM's own example pair, 5557/5558): a router that joins late asks it for the batches it missed.
KV_EVENTS_REPLAY_PORT_OFFSET = 1
KV_EVENTS_REPLAY_PORT_NAME = "kv-replay"


def kv_events_replay_port(events_port: int) -> int:
    return events_port + KV_EVENTS_REPLAY_PORT_OFFSET


# --- files the operator mounts into an engine pod and the launcher reads
SPEC_MOUNT_DIR = "/etc/kvfleet"
SPEC_FILE = "spec.json"
# Beside spec.json: the public keys whose artifact signatures the launcher accepts.
ARTIFACT_KEYS_FILE = "artifact-keys.pem"
# The pinned model digest: one file, PIN_KEY, in its own ConfigMap volume. Beside the spec's mount,
# not inside it: a mount point inside a ConfigMap volume is not portable.
PIN_MOUNT_DIR = "/etc/kvfleet-pin"
PIN_KEY = "modelDigest"
NODE_CACHE_MOUNT = "/var/cache/kvfleet"

# --- vLLM's metric names (vllm/v1/metrics/loggers.py): the reference engine exposes the same, so the
# router, the autoscaler, local mode and the dashboards read vLLM and the reference engine alike.
# Every series carries a ``model_name`` label (the served name). Counters gain ``_total`` on the wire.
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_NUM_PREEMPTIONS = "vllm:num_preemptions"
VLLM_REQUEST_SUCCESS = "vllm:request_success"
VLLM_TTFT_SECONDS = "vllm:time_to_first_token_seconds"
VLLM_ITL_SECONDS = "vllm:inter_token_latency_seconds"
VLLM_E2E_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
VLLM_MODEL_LABEL = "model_name"

# --- the router's series the autoscaler reads, labelled ``namespace`` and ``model`` (the deployment's
# namespace and served name). The requests counter gains ``_total`` on the wire.
ROUTER_REQUESTS = "kvfleet_router_requests"
ROUTER_QUEUE_DEPTH = "kvfleet_router_queue_depth"
ROUTER_INFLIGHT = "kvfleet_router_inflight"

# --- what a client sees of a request the router held while its model had no ready replica: the
# seconds it was held before its response head went out (docs/router.md, Held through a cold start).
COLD_START_HEADER = "X-Kvfleet-Cold-Start"
