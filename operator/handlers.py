"""Thin kopf handlers over the reconciler, registered into a registry built from typed settings.

Every handler calls the same level-based reconcile, so which one fires (create, update, resume,
the resync timer, or the watch of status.desiredReplicas) never changes the result. Errors are
translated here, once: an API that did not answer becomes ``kopf.TemporaryError`` (kopf retries
with a delay, a bounded number of times); everything the reconciler can decide on its own
(an invalid spec, an apply the server refused) is reported in status and not retried in a loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

import kopf

from kvfleet.kube import KubeError
from kvfleet.kube.watch import without_managed_fields
from kvfleet.spec import GROUP, PLURAL, VERSION

from . import claims
from .claims import Claim
from .reconcile import Outcome, Reconciler
from .settings import FINALIZER, KOPF_PREFIX, OperatorSettings
from .slots import Priority

log = logging.getLogger(__name__)

TIMER_EXIT_POLL_S = 1.0  # how often a deletion checks that a running timer has exited


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    """Where kopf keeps its bookkeeping, and how it posts events and peers.

    kopf's progress and diff-base go to annotations under kvfleet.io/: the CRD's status schema is
    strict (the API server would prune a ``status.kopf`` field, and kopf would then redo its work
    forever), and annotations that are not in Git are ignored by Argo CD's diff (they belong to
    another field manager), so they cause no drift. spec is never written.
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
    # A timer caught mid-run by a deletion holds the finalizer until kopf polls it again, 60 s by
    # default: a deleted deployment kept its served name (and another namespace waited for it) for
    # a minute. Our timers are short API reads, so polling every second frees it promptly.
    settings.background.cancellation_polling = TIMER_EXIT_POLL_S
    # Serve the resources found at startup only: no list/watch on CRDs and namespaces in RBAC.
    # The chart installs the CRD before the operator; a new CRD version needs an operator restart.
    settings.scanning.disabled = True
    settings.peering.name = ours.peering_name or "kvfleet"
    settings.peering.priority = ours.priority
    settings.peering.lifetime = ours.peering_lifetime_s
    settings.peering.standalone = ours.peering_name is None
    settings.peering.mandatory = ours.peering_name is not None
    settings.peering.clusterwide = not ours.namespaces


def unsettled(body: dict[str, Any]) -> bool:
    """Status says pods are still coming, or failing: worth a look sooner than the calm resync."""
    conditions = {c.get("type"): c for c in ((body.get("status") or {}).get("conditions") or [])}
    if not conditions:
        return False  # not reconciled yet: the create handler runs anyway
    ready, progressing, degraded = (conditions.get(t) or {} for t in ("Ready", "Progressing", "Degraded"))
    if degraded.get("reason") in ("InvalidSpec", "PolicyViolation"):
        return False  # nothing to watch until the spec changes
    if degraded.get("reason") == claims.REASON:
        return True  # the older claimant may go or rename at any time: look again soon
    return ready.get("status") != "True" or progressing.get("status") == "True" or degraded.get("status") == "True"


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


class OutsideKopf:
    """Reconciles an InferenceDeployment from outside kopf's handlers (the rollout nudges).

    What such a reconcile needs of kopf is taken from the first handler that runs: the watched
    bodies and the served-name claims (kopf's indexes, live views), and the handler's context,
    where ``kopf.event`` finds the operator's event queue (a task kopf did not start has none).
    Until a handler has run (the resume handlers at start-up), a nudge waits.
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

    async def reconcile(self, namespace: str, name: str) -> None:
        await self._bound.wait()
        assert self._context is not None and self._bodies is not None and self._claims is not None
        store = self._bodies.get((namespace, name))
        body = next(iter(store), None) if store is not None else None
        if body is None:
            return  # deleted meanwhile: kopf's delete handler has it
        index = self._claims

        def claimants(served: str) -> list[Claim]:
            return list(index.get(served, ()))

        task = asyncio.create_task(
            # A nudge brings status up to date with its rollout: ahead of queued changes (slots.py).
            self.reconciler.reconcile(namespace, name, claimants, dict(body), priority=Priority.STATUS),
            context=self._context.copy(),
        )
        outcome = await task
        _check(outcome, log)


def build_registry(
    reconciler: Reconciler, ours: OperatorSettings, outside: OutsideKopf | None = None
) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers; nothing is registered globally. ``outside``
    is bound to kopf's indexes and context by the first handler run (the rollout nudges use it)."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    # Every deployment's body as kopf's watch last delivered it, for reconciles started outside
    # kopf's handlers (a rollout nudge): they plan from it as a handler does.
    @kopf.index(*resource, registry=registry, id="bodies")
    def bodies(*, namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
        return {(str(namespace), name): dict(without_managed_fields(dict(body)))}  # 1,000 of them: no managedFields

    # Every deployment's claim on its served name, kept by kopf from the watch it runs anyway (no
    # LIST per reconcile); a handler reads the claimants of one name from it.
    @kopf.index(*resource, registry=registry, id="served_names")
    def served_names(*, namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[str, Claim] | None:
        found = claims.claim_of(str(namespace), name, dict(body))
        return {found[0]: found[1]} if found is not None else None

    async def run(
        namespace: str | None,
        name: str,
        logger: Any,
        index: kopf.Index[str, Claim],
        body: kopf.Body,
        bodies_index: kopf.Index[tuple[str, str], dict[str, Any]],
        wait: bool = True,
        priority: Priority = Priority.CHANGE,
    ) -> None:
        assert namespace is not None  # InferenceDeployments are namespaced
        if outside is not None:
            outside.bind(bodies_index, index)

        def claimants(served: str) -> list[Claim]:
            return list(index.get(served, ()))

        try:
            # The watched body: a reconcile with nothing to change then sends no request at all.
            outcome = await reconciler.reconcile(namespace, name, claimants, dict(body), wait=wait, priority=priority)
            _check(outcome, logger)
        except KubeError as e:
            what = "API server unavailable" if e.retryable else "API call failed"
            raise kopf.TemporaryError(f"{what}: {e}", delay=ours.retry_delay_s) from e

    @kopf.on.resume(*resource, registry=registry, retries=ours.max_retries)
    @kopf.on.create(*resource, registry=registry, retries=ours.max_retries)
    @kopf.on.update(*resource, registry=registry, retries=ours.max_retries)
    async def reconcile_change(*, namespace: str | None, name: str, logger: Any, **kwargs: Any) -> None:
        await run(namespace, name, logger, kwargs["served_names"], kwargs["body"], kwargs["bodies"])  # indexes by name

    # Drift: a child deleted or edited by hand, readiness that changed, a launcher that reported.
    @kopf.timer(*resource, registry=registry, interval=ours.resync_interval_s, initial_delay=ours.resync_interval_s)
    async def resync(*, namespace: str | None, name: str, logger: Any, **kwargs: Any) -> None:
        # Timers do not queue for a busy operator (Reconciler.reconcile, wait=False): they come again.
        await run(namespace, name, logger, kwargs["served_names"], kwargs["body"], kwargs["bodies"], wait=False)

    # While it is not settled (not Ready, progressing or degraded), look every few seconds: pod
    # failures change no object the operator watches, so only a check reads them in time.
    @kopf.timer(
        *resource,
        registry=registry,
        interval=ours.rollout_check_interval_s,
        initial_delay=ours.rollout_check_interval_s,
        when=lambda body, **_: unsettled(dict(body)),
    )
    async def rollout_check(*, namespace: str | None, name: str, logger: Any, **kwargs: Any) -> None:
        await run(namespace, name, logger, kwargs["served_names"], kwargs["body"], kwargs["bodies"], wait=False)

    # The autoscaler writes status.desiredReplicas; status is not in kopf's diff, so watch events.
    @kopf.on.event(*resource, registry=registry, when=lambda body, **_: reconciler.replicas_stale(dict(body)))
    async def rescale(*, namespace: str | None, name: str, logger: Any, **kwargs: Any) -> None:
        # A new replica count (a wake from zero among them) goes ahead of queued changes (slots.py).
        await run(
            namespace, name, logger, kwargs["served_names"], kwargs["body"], kwargs["bodies"], priority=Priority.STATUS
        )

    @kopf.on.delete(*resource, registry=registry, retries=ours.max_retries)
    async def cleanup(*, body: kopf.Body, namespace: str | None, name: str, logger: Any, **_: Any) -> None:
        assert namespace is not None
        try:
            deleted = await reconciler.delete_children(namespace, name)
        except KubeError as e:
            raise kopf.TemporaryError(f"deleting children failed: {e}", delay=ours.retry_delay_s) from e
        logger.info("deleted %s", ", ".join(deleted) or "nothing (children were gone)")
        kopf.event(body, type="Normal", reason="Deleted", message=f"deleted {len(deleted)} children")

    return registry
