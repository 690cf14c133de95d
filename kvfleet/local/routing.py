"""Local mode's edge to the router: the registry the process actuator tells about replicas, and
the router settings for engines that publish KV-cache events.

In a cluster the router learns replicas from EndpointSlices; here the process actuator adds a
replica once its ``/health`` answers and takes it out when it drains or dies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvfleet.local.models import EngineLaunch
from kvfleet.resource import InferenceDeployment
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.settings import RouterSettings

# The router's kv_events_port turns subscriptions on; every local engine announces its own port with
# kv_events_announced_only, so this value is never dialled.
LOCAL_KV_EVENTS_PORT = 5557


def local_router_settings(
    base: RouterSettings, deployments: Sequence[InferenceDeployment], launches: Mapping[str, EngineLaunch]
) -> RouterSettings:
    """The router subscribes to the engines that publish KV-cache events, tokenizing each such model's
    prompts with its own folder (the tiny model's tokenizer.json and chat template included)."""
    tokenizers = {d.served_name: str(launches[d.name].model_path) for d in deployments if launches[d.name].kv_events}
    if not tokenizers:
        return base
    return base.model_copy(
        update={
            "kv_events_port": LOCAL_KV_EVENTS_PORT,
            "kv_events_announced_only": True,
            "kv_events_tokenizers": tokenizers,
        }
    )


@dataclass
class RouterRegistry:
    """The actuator's view of the router: replicas by deployment name, mapped to served names."""

    source: StaticReplicaSource
    served: dict[str, str]
    inflight_of: Callable[[str], dict[str, int]]
    on_change: Callable[[], None] = lambda: None

    def add(self, deployment: str, replica_id: str, url: str, kv_events_port: int | None = None) -> None:
        self.source.add(self.served[deployment], replica_id, url, kv_events_port=kv_events_port)
        self.on_change()

    def mark_draining(self, deployment: str, replica_id: str) -> None:
        with contextlib.suppress(KeyError):  # already removed (it died meanwhile)
            self.source.mark_draining(self.served[deployment], replica_id)

    def remove(self, deployment: str, replica_id: str) -> None:
        self.source.remove(self.served[deployment], replica_id)
        self.on_change()

    def inflight(self, deployment: str, replica_id: str) -> int:
        return self.inflight_of(self.served[deployment]).get(replica_id, 0)
