"""Before kopf starts: wait until the API server lists InferenceDeployments.

Why: right after a CRD is created (``helm install`` creates it moments before the operator's pod
starts) the API server answers its LISTs with 429 "storage is (re)initializing" for a second or
two. kopf's watcher retries, but logs each try as an ERROR, so a fresh, healthy install showed
errors in the operator's log (the real node's chart test caught it). Waiting here, on the same
back-off the watches use, turns that into an INFO line; a failure that cannot heal (403: the
RBAC does not grant the list) ends the start with its reason instead of a retry loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from kvfleet.kube import KubeClient, KubeError
from kvfleet.kube.backoff import Backoff
from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS

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
    if not 1 <= attempts <= 100:
        raise ValueError(f"attempts must be in [1, 100], got {attempts}")
    backoff = backoff or Backoff()
    for scope in namespaces or (None,):
        for attempt in range(attempts):
            try:
                await client.get(INFERENCE_DEPLOYMENTS.collection(scope), {"limit": "1"})
                break
            except KubeError as e:
                if not e.retryable or attempt == attempts - 1:
                    raise
                wait_s = backoff.wait_s(attempt, e.retry_after_s, rand)
                log.info("InferenceDeployments not served yet (%s); asking again in %.1fs", e, wait_s)
                await asyncio.sleep(wait_s)
