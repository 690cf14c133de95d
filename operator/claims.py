"""Served-name claims: the operator refuses the newer of two InferenceDeployments serving one name.

The router routes only the older claimant (kvfleet.served_names); the operator says so in the
newer one's status (Ready=False, reason ServedNameConflict, naming the other owner) and creates no
pods for it, so a namespace can neither shadow another's model nor burn GPUs on one that takes no
traffic. Claims come from a kopf index over every InferenceDeployment the operator watches; pure
functions here decide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfleet.served_names import claim_order, created_unix_s
from kvfleet.spec import InferenceDeploymentSpec

REASON = "ServedNameConflict"


@dataclass(frozen=True)
class Claim:
    """One deployment's claim on a served name."""

    namespace: str
    name: str
    created_unix_s: int | None

    def order(self) -> tuple[float, str, str]:
        return claim_order(self.created_unix_s, self.namespace, self.name)


Claimants = Callable[[str], Iterable[Claim]]
"""Served name -> every deployment that claims it (the kopf index's view)."""


def claim_of(namespace: str, name: str, body: Mapping[str, Any]) -> tuple[str, Claim] | None:
    """(served name, claim) of one InferenceDeployment; None when its spec is invalid (it serves nothing)."""
    try:
        spec = InferenceDeploymentSpec.model_validate(body.get("spec") or {})
    except ValidationError:
        return None
    return spec.served_name(name), Claim(namespace, name, created_unix_s(body))


def holder(served_name: str, me: Claim, claimants: Iterable[Claim]) -> Claim | None:
    """The older claimant that keeps ``served_name`` from ``me``, or None when ``me`` keeps it."""
    others = [c for c in claimants if (c.namespace, c.name) != (me.namespace, me.name)]
    oldest = min([me, *others], key=Claim.order)
    return None if oldest == me else oldest


def conflict_message(served_name: str, owner: Claim) -> str:
    since = (
        datetime.fromtimestamp(owner.created_unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if owner.created_unix_s is not None
        else "an unknown time"
    )
    return f'served name "{served_name}" is already served by {owner.namespace}/{owner.name} since {since}'
