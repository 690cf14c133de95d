"""examples/tiny.yaml on the real node with the CPU engine image built from
`engine_image/Dockerfile.cpu`: the launcher pulls the model from a real S3 server (SeaweedFS, the
model uploaded with `kvfleet cache populate`) into the node cache (a hostPath the chart's policy
allows), and a completion through the router's Service wakes the deployment from zero and returns
the engine's text. A second deployment of the same model on the node reads the node cache (the S3
server sends none of the model's bytes), and deleting both collects every child.

One deployment per step, shared by the module: an engine pod's cold start is tens of seconds here.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import boto3
import pytest
import yaml
from support.real_cluster import wait_for
from support.real_node import BIN, NODE_CACHE_ROOT, REPO, RealNodeCluster, into_node

from kvfleet.devcluster.realnode.settings import NODE_NAME
from kvfleet_testkit.seaweedfs import SeaweedS3

# A cold run builds the engine image (torch: GBs) in the first test's fixtures.
pytestmark = pytest.mark.timeout(3000)

NAMESPACE = "default"
BUCKET = "node-models"
SECRET = "s3-credentials"
CACHE_BOUND = "512Mi"  # the node cache's sizeLimit: the tiny model is a few MB
REQUEST_TIMEOUT_S = 420.0  # a wake from zero: pod start, torch import, pull, engine start, on a busy machine


@dataclass(frozen=True)
class S3Model:
    endpoint_in_node: str  # where pods reach the S3 server
    uri: str
    total_bytes: int
    smallest_shard: int
    server: SeaweedS3


def _bucket_bytes_sent(server: SeaweedS3) -> float:
    """SeaweedFS's own count of the bytes its S3 gateway sent for the bucket."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    pattern = rf'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{{[^}}]*bucket="{BUCKET}"[^}}]*\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


@pytest.fixture(scope="module")
def s3_model(
    real_node: RealNodeCluster, seaweedfs: SeaweedS3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[S3Model]:
    model = tmp_path_factory.mktemp("model") / "tiny"
    env = {**real_node.env, **seaweedfs.env()}
    subprocess.run([str(BIN / "kvfleet"), "engine", "make-tiny-model", str(model)], check=True, env=env, timeout=300)
    boto3.client(
        "s3",
        endpoint_url=seaweedfs.endpoint_url,
        aws_access_key_id=seaweedfs.access_key,
        aws_secret_access_key=seaweedfs.secret_key,
        region_name=seaweedfs.region,
    ).create_bucket(Bucket=BUCKET)
    uri = f"s3://{BUCKET}/tiny"
    subprocess.run(
        [str(BIN / "kvfleet"), "cache", "populate", str(model), uri, "--quiet"], check=True, env=env, timeout=300
    )
    shards = [f.stat().st_size for f in model.iterdir() if f.suffix == ".safetensors"]
    total = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    port = urlparse(seaweedfs.endpoint_url).port
    assert port is not None
    with into_node(real_node, port) as endpoint:
        yield S3Model(endpoint, uri, total, min(shards), seaweedfs)


def tiny(name: str, image: str, model: S3Model) -> dict[str, Any]:
    """examples/tiny.yaml with the model in S3 and the node cache on the node's disk."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}  # no make-tiny-model: local mode's
    spec = doc["spec"]
    spec["model"] = {"uri": model.uri, "servedName": name}
    spec["engine"]["image"] = image
    spec["cache"] = {
        "s3Endpoint": model.endpoint_in_node,
        "region": model.server.region,
        "credentialsSecret": SECRET,
        "nodeCache": {"type": "hostPath", "hostPath": NODE_CACHE_ROOT, "sizeLimit": CACHE_BOUND},
    }
    # Two engines beside the chart's four pods on a 2-core node: at tiny.yaml's one CPU each the
    # second stays Pending (Insufficient cpu), which kwok's roomy fake nodes never showed.
    spec["resources"]["cpu"] = "500m"
    # A cold start here is a pod start plus torch's import on a shared 2-core machine.
    spec["autoscaling"]["coldStartSeconds"] = 120
    spec["routing"]["maxQueueWaitSeconds"] = 300
    return doc


def complete(cluster: RealNodeCluster, model: str, prompt: str = "The node") -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{cluster.node['router']}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[-2000:]}


def engine_pods(cluster: RealNodeCluster, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl.json(
        "get", "pods", "-n", NAMESPACE, "-l", f"kvfleet.io/deployment={name}"
    )["items"]
    return [p for p in items if p["metadata"].get("deletionTimestamp") is None]


def pull_phase(cluster: RealNodeCluster, pod: str) -> dict[str, Any]:
    """The launcher's `pull` cold-start record from the engine pod's log."""
    log = cluster.kubectl("logs", "-n", NAMESPACE, pod)
    for line in log.splitlines():
        start = line.find("{")
        if start >= 0 and '"coldstart_phase"' in line:
            record = json.loads(line[start:])
            if record.get("phase") == "pull":
                return dict(record)
    raise AssertionError(f"no pull phase in {pod}'s log:\n{log[-3000:]}")


@pytest.fixture(scope="module")
def engine_ready(real_node: RealNodeCluster, chart: str, engine_image: str, s3_model: S3Model) -> S3Model:
    kubectl = real_node.kubectl
    server = s3_model.server
    kubectl(
        *("create", "secret", "generic", SECRET, "-n", NAMESPACE),
        f"--from-literal=AWS_ACCESS_KEY_ID={server.access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={server.secret_key}",
    )
    return s3_model


def test_tiny_pulls_from_s3_and_answers_through_the_router(
    real_node: RealNodeCluster, engine_ready: S3Model, engine_image: str
) -> None:
    kubectl = real_node.kubectl
    sent_before = _bucket_bytes_sent(engine_ready.server)
    kubectl.apply([tiny("tiny", engine_image, engine_ready)])
    # minReplicas 0: nothing runs until a request comes.
    wait_for(lambda: kubectl.get("deployment", "tiny-engine", NAMESPACE), 60, "the engine Deployment")
    assert not engine_pods(real_node, "tiny")

    t0 = time.monotonic()
    status, answer = complete(real_node, "tiny")
    woke_s = time.monotonic() - t0
    assert status == 200, answer
    assert answer["choices"][0]["text"], answer
    print(f"woken from zero and answered in {woke_s:.0f} s")

    (pod,) = engine_pods(real_node, "tiny")
    assert pod["spec"]["nodeName"] == NODE_NAME
    (container,) = pod["status"]["containerStatuses"]
    assert container["ready"] and container["image"] == engine_image
    pull = pull_phase(real_node, pod["metadata"]["name"])
    assert pull["source"] == "s3" and pull["bytesFetched"] >= engine_ready.total_bytes * 0.9, pull
    assert _bucket_bytes_sent(engine_ready.server) - sent_before >= pull["bytesFetched"]
    # In the node cache on the node's disk, under the namespace's own folder.
    cache = real_node.node_path(NODE_CACHE_ROOT)
    assert [p for p in (cache / NAMESPACE).rglob("*.safetensors")], "no weights in the node cache"
    wait_for(
        lambda: (
            {c["type"]: c for c in kubectl.json("get", "infd", "tiny", "-n", NAMESPACE)["status"]["conditions"]}[
                "Ready"
            ]["status"]
            == "True"
        ),
        120,
        "status Ready",
    )


def test_a_second_engine_pod_reads_the_node_cache(
    real_node: RealNodeCluster, engine_ready: S3Model, engine_image: str
) -> None:
    """Another deployment of the same model in the namespace: its pod finds the weights in the
    node cache, and the S3 server sends fewer bytes than the smallest shard while it starts."""
    sent_before = _bucket_bytes_sent(engine_ready.server)
    real_node.kubectl.apply([tiny("tiny-b", engine_image, engine_ready)])
    status, answer = complete(real_node, "tiny-b")
    assert status == 200 and answer["choices"][0]["text"], answer
    (pod,) = engine_pods(real_node, "tiny-b")
    pull = pull_phase(real_node, pod["metadata"]["name"])
    assert pull["source"] == "node-cache" and pull["bytesFetched"] == 0, pull
    sent = _bucket_bytes_sent(engine_ready.server) - sent_before
    assert sent < engine_ready.smallest_shard, f"S3 sent {sent} bytes to a pod that had the model on its node"


def test_delete_collects_every_child_and_the_cache_stays_bounded(
    real_node: RealNodeCluster, engine_ready: S3Model
) -> None:
    kubectl = real_node.kubectl
    kinds = "deployments,services,configmaps,poddisruptionbudgets,pods"
    selector = "kvfleet.io/deployment in (tiny,tiny-b)"
    assert kubectl.json("get", kinds, "-n", NAMESPACE, "-l", selector)["items"]
    kubectl("delete", "inferencedeployment", "tiny", "tiny-b", "-n", NAMESPACE, "--wait=true", timeout_s=180)

    def children() -> list[str]:
        items = kubectl.json("get", kinds, "-n", NAMESPACE, "-l", selector)["items"]
        return [f"{i['kind']}/{i['metadata']['name']}" for i in items]

    wait_for(lambda: not children(), 180, "every child garbage-collected")
    cache = real_node.node_path(NODE_CACHE_ROOT)
    used = sum(f.stat().st_size for f in (cache / NAMESPACE).rglob("*") if f.is_file())
    assert 0 < used <= 512 * 2**20, used  # CACHE_BOUND; the model stays for the next pod
