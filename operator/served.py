"""Before kopf starts: wait until the API server lists InferenceDeployments.

Why: right after a CRD is created (``helm install`` creates it moments before the operator's pod
starts) the API server answers its LISTs with 429 "storage is (re)initializing" for a second or
two. kopf's watcher retries, but logs each try as an ERROR, so a fresh, healthy install showed
errors in the operator's log (the real node's chart test caught it). Waiting here, on the same
back-off the watches use, turns that into an INFO line; a failure that cannot heal (403: the
RBAC does not grant the list) ends the start with its reason instead of a retry loop.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable

from kvfleet.kube import KubeClient
from kvfleet.kube.backoff import Backoff
from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS
from kvfleet.kube.retry import retry_while_healing

log = logging.getLogger(__name__)

START_ATTEMPTS = 8  # with the default back-off, about a minute and a half in all


async def wait_until_served(
    client: KubeClient,
    namespaces: tuple[str, ...] = (),
    *,
    attempts: int = START_ATTEMPTS,
    backoff: Backoff | None = None,
    rand: Callable[[], float] = random.random,
) -> None:
    """One LIST (``limit=1``) of InferenceDeployments per scope the operator serves (the cluster,
    or each namespace), retried while the failure can heal; raises the last ``KubeError``."""
    for scope in namespaces or (None,):
        path = INFERENCE_DEPLOYMENTS.collection(scope)
        await retry_while_healing(
            functools.partial(client.get, path, {"limit": "1"}),
            attempts=attempts,
            backoff=backoff or Backoff(),
            what=f"InferenceDeployments not served yet: list {path}",
            log=log,
            level=logging.INFO,
            rand=rand,
        )
