"""Thin kopf handlers over the reconciler, registered into a registry built from typed settings.

One event handler decides from each watched body whether to reconcile (a spec not yet observed, a
replica count not yet applied); the periodic looks (``periodic.py``) and the rollout nudges
(``rollout_nudge.py``) reconcile through ``OutsideKopf``. All call the same level-based reconcile,
so which one fires never changes the result. An API that did not answer is logged and left to the
periodic looks (the deployment stays due); everything the reconciler can decide on its own (an
invalid spec, an apply the server refused) is reported in status and not retried in a loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

import kopf

from kvfleet.kube import KubeError
from kvfleet.kube.watch import without_managed_fields
from kvfleet.spec import GROUP, PLURAL, VERSION

from . import claims
from .claims import Claim, Claimants
from .reconcile import Outcome, Reconciler
from .settings import FINALIZER, KOPF_PREFIX, OperatorSettings
from .slots import Priority

log = logging.getLogger(__name__)


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    """How kopf posts events and peers, and the finalizer name it knows.

    kopf writes nothing to an InferenceDeployment now (no handler of ours needs its finalizer,
    progress or diff-base): the finalizer is named only so that kopf removes it from objects an
    older operator put it on (kopf drops a finalizer no handler requires). spec is never written.
    """
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    # Events come from our transitions only; kopf's own log lines are not posted.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "kvfleet-operator"
    # Serve the resources found at startup only: no list/watch on CRDs and namespaces in RBAC.
    # The chart installs the CRD before the operator; a new CRD version needs an operator restart.
    settings.scanning.disabled = True
    settings.peering.name = ours.peering_name or "kvfleet"
    settings.peering.priority = ours.priority
    settings.peering.lifetime = ours.peering_lifetime_s
    settings.peering.standalone = ours.peering_name is None
    settings.peering.mandatory = ours.peering_name is not None
    settings.peering.clusterwide = not ours.namespaces


def _check(outcome: Outcome, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    if outcome.invalid and outcome.events:  # once per change, not on every resync
        logger.warning("spec is invalid, children left unchanged: %s", outcome.invalid)
    if outcome.refused and outcome.events:
        logger.warning("spec refused by the platform policy, children left unchanged: %s", outcome.refused)
    if outcome.conflict and outcome.events:
        logger.warning("not served, children left unchanged: %s", outcome.conflict)
    if outcome.apply_error:
        logger.warning("apply refused: %s", outcome.apply_error)
    if outcome.applied:
        logger.info("applied %s", ", ".join(outcome.applied))


def claimants_in(index: kopf.Index[str, Claim]) -> Claimants:
    """The deployments claiming a served name, read from kopf's claims index."""

    def claimants(served: str) -> list[Claim]:
        return list(index.get(served, ()))

    return claimants


class OutsideKopf:
    """Reconciles an InferenceDeployment from outside kopf's handlers (periodic looks, nudges).

    What such a reconcile needs of kopf is taken from the first event handler that runs: the
    watched bodies and the served-name claims (kopf's indexes, live views), and the handler's
    context, where ``kopf.event`` finds the operator's event queue (a task kopf did not start has
    none). Until an event has come (kopf's start-up listing), a reconcile waits and ``bodies`` is empty.
    """

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self._context: contextvars.Context | None = None
        self._bodies: kopf.Index[tuple[str, str], dict[str, Any]] | None = None
        self._claims: kopf.Index[str, Claim] | None = None
        self._bound = asyncio.Event()

    def bind(self, bodies: kopf.Index[tuple[str, str], dict[str, Any]], claims_index: kopf.Index[str, Claim]) -> None:
        if self._context is None:
            self._context = contextvars.copy_context()
            self._bodies, self._claims = bodies, claims_index
            self._bound.set()

    def bodies(self) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
        """Every watched deployment's last body (none until bound)."""
        if self._bodies is None:
            return
        for key, store in list(self._bodies.items()):
            body = next(iter(store), None)
            if body is not None:
                yield key, body

    async def reconcile(self, namespace: str, name: str, *, wait: bool = True) -> Outcome | None:
        """A nudge (``wait``: it queues for a slot) or a periodic look (``wait=False``: skipped when
        the deployment or every slot is busy, and looked at again at the next tick)."""
        await self._bound.wait()
        assert self._context is not None and self._bodies is not None and self._claims is not None
        store = self._bodies.get((namespace, name))
        body = next(iter(store), None) if store is not None else None
        if body is None:
            return None  # deleted meanwhile
        task = asyncio.create_task(
            # Status brought up to date with a rollout, or a look: ahead of queued changes (slots.py).
            self.reconciler.reconcile(
                namespace, name, claimants_in(self._claims), dict(body), wait=wait, priority=Priority.STATUS
            ),
            context=self._context.copy(),
        )
        outcome = await task
        _check(outcome, log)
        return outcome


def spec_unobserved(body: dict[str, Any]) -> bool:
    """Pure: the spec changed (or is new) since the last status the operator wrote: the API server
    moves metadata.generation on every spec change and on nothing else (the CRD has a status
    subresource), and every status write records the generation it saw."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    return (body.get("status") or {}).get("observedGeneration") != meta.get("generation")


def build_registry(reconciler: Reconciler, ours: OperatorSettings, outside: OutsideKopf) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers; nothing is registered globally. ``outside``
    is bound to kopf's indexes and context by the first event (the periodic looks and the rollout
    nudges reconcile through it).

    kopf here is the watch, the indexes and the Event poster; the decision of when to reconcile is
    ours, from the body alone (a spec not yet observed, a replica count not yet applied). No create,
    update, resume, timer or delete handler: each of those makes kopf write to the object (a
    finalizer, its diff-base annotation), 2 writes per create that every InferenceDeployment
    watcher sees (docs/operator.md). The resync and rollout check are ``periodic.py``'s; children
    go with their owner by Kubernetes' garbage collection (their ownerReferences)."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    # Every deployment's body as kopf's watch last delivered it, for reconciles started outside
    # kopf's handlers (the periodic looks, rollout nudges): they plan from it as a handler does.
    # Both indexers are coroutines though they never wait: kopf runs a plain function in its thread
    # pool, a hand-off to a thread and back for each of them on every watch event (~3,400 events in
    # an apply of 1,000 deployments).
    @kopf.index(*resource, registry=registry, id="bodies")
    async def bodies(
        *, namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(str(namespace), name): dict(without_managed_fields(dict(body)))}  # 1,000 of them: no managedFields

    # Every deployment's claim on its served name, kept by kopf from the watch it runs anyway (no
    # LIST per reconcile); a handler reads the claimants of one name from it.
    @kopf.index(*resource, registry=registry, id="served_names")
    async def served_names(*, namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[str, Claim] | None:
        found = claims.claim_of(str(namespace), name, dict(body))
        return {found[0]: found[1]} if found is not None else None

    # Every watch event (the start-up listing among them); most need nothing, decided from the body.
    @kopf.on.event(*resource, registry=registry)
    async def watched(*, type: str | None, namespace: str | None, name: str, logger: Any, **kwargs: Any) -> None:
        assert namespace is not None  # InferenceDeployments are namespaced
        outside.bind(kwargs["bodies"], kwargs["served_names"])
        if type == "DELETED":
            reconciler.forget(namespace, name)  # its children go by garbage collection
            return
        body = dict(kwargs["body"])
        # A new or changed spec renders and applies children; a new replica count (the autoscaler's,
        # a wake among them) is status work and goes ahead of queued changes (slots.py).
        if spec_unobserved(body):
            priority = Priority.CHANGE
        elif reconciler.replicas_stale(body):
            priority = Priority.STATUS
        else:
            return
        try:
            # The watched body: a reconcile with nothing to change then sends no request at all.
            claimants = claimants_in(kwargs["served_names"])
            outcome = await reconciler.reconcile(namespace, name, claimants, body, priority=priority)
            _check(outcome, logger)
        except KubeError as e:
            # Not retried here: the deployment stays due, and the periodic looks retry it.
            what = "API server unavailable" if e.retryable else "API call failed"
            logger.warning("reconcile failed (%s), looked at again in %.0f s: %s", what, ours.retry_delay_s, e)

    return registry
