"""One reconcile of one InferenceDeployment: read, decide (pure), write only what differs.

Level-based and idempotent: the watch's event handler (a new spec, a new replica count), the
periodic looks and the rollout nudges all call the same ``reconcile``; a converged deployment costs
reads only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from kvfleet.kube import KubeClient, KubeConflict, KubeError, KubeNotFound, KubeRejected, Ref
from kvfleet.kube.ref import INFERENCE_DEPLOYMENTS
from kvfleet.kube.watch import without_managed_fields
from kvfleet.served_names import created_unix_s
from kvfleet.spec import API_VERSION, KIND
from kvfleet.validation import validate_spec

from . import names
from .child_cache import ChildCache, ObjectReads, version_number
from .claims import Claim, Claimants, conflict_message, holder
from .coldstart import ColdStartProbe, LauncherReport
from .conditions import DeploymentObservation, Observed, plan_status
from .drift import first_difference
from .pin import decide_pin, pin_from_configmap
from .pod import pod_spec_hash
from .pod_health import diagnose_pods
from .policy import violations
from .pull_progress import PullProgressProbe
from .render import (
    CHILD_KINDS,
    CONFIGMAP,
    DEPLOYMENT,
    SERVICE_MONITOR,
    ChildKind,
    Owner,
    apply_waves,
    kind_of,
    render_children,
)
from .replicas import decide_replicas
from .settings import FIELD_MANAGER, OperatorSettings
from .slots import Priority, Slots

log = logging.getLogger(__name__)

INFD = INFERENCE_DEPLOYMENTS
PODS = Ref("v1", "pods")
DISCOVERY_TTL_S = 300.0


def ref_of(kind: ChildKind) -> Ref:
    return Ref(kind.api_version, kind.plural)


class _ReadAgain(Exception):
    """A reconcile planned from a watched body found the object moved on (its status write got a
    409, or there was nothing new to write but transitions to post): it reads the object afresh and
    plans again. ``applied``: what it had applied by then (kept in the outcome)."""

    def __init__(self, applied: list[str] | None = None) -> None:
        super().__init__()
        self.applied = applied or []


class EventPoster(Protocol):
    def __call__(self, obj: dict[str, Any], *, type: str, reason: str, message: str) -> None: ...


@dataclass
class Outcome:
    """What one reconcile did, for logs and tests."""

    applied: list[str] = field(default_factory=list)  # "Deployment/x-engine (spec.replicas)"
    status_written: bool = False
    events: list[str] = field(default_factory=list)
    invalid: str | None = None
    refused: str | None = None  # the platform policy's refusal ("spec.x: why")
    conflict: str | None = None  # the served name is another, older deployment's (claims.py)
    apply_error: str | None = None
    gone: bool = False
    skipped: bool = False  # a timer's reconcile not run: the deployment's or every slot was taken


def _object_ref(body: dict[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
    }


class Reconciler:
    """Reconciles InferenceDeployments through an injected API client, clock and event poster."""

    def __init__(
        self,
        client: KubeClient,
        settings: OperatorSettings,
        *,
        post_event: EventPoster,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        coldstart: ColdStartProbe | None = None,
        pull_progress: PullProgressProbe | None = None,
        cache: ChildCache | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        # Children and pods are read from the watches' cache when there is one (child_cache.py).
        self._cache = cache
        self._reads: ObjectReads = cache if cache is not None else client
        self._settings = settings
        self._post_event = post_event
        self._clock = clock
        self._coldstart = coldstart
        self._pull_progress = pull_progress
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Bounds the reconciles that run at once (settings.max_concurrent_reconciles): each one
        # started finishes before a later one starts sending, so a pass over 1,000 deployments
        # moves deployment by deployment instead of breadth-first; status-only work first (slots.py).
        self._running = Slots(settings.max_concurrent_reconciles)
        # Replica count last applied per deployment: lets the watch handler skip events that do
        # not change the decision (most of them: our own status writes, the autoscaler's reasons).
        self._applied_replicas: dict[tuple[str, str], int] = {}
        self._service_monitors: tuple[float, bool] | None = None
        self._discovery = asyncio.Lock()
        # Each deployment as our last status write returned it, until a watched body is as new:
        # a handler or nudge that runs before kopf's watch delivers our own write plans from this
        # instead of reading the object again (a GET per reconcile at scale, docs/operator.md).
        self._own_status: dict[tuple[str, str], dict[str, Any]] = {}
        # The resourceVersion of our last status write, kept: a body at least as new holds it, so
        # a status planned from it posts no transition twice and needs no fresh read.
        self._own_version: dict[tuple[str, str], int] = {}
        # The newest resourceVersion each deployment was planned from: a watched body older than that
        # (an event queued behind a reconcile that read the object afresh) is never applied from,
        # which would roll the engines back to a spec already replaced and then forward again.
        self._planned_version: dict[tuple[str, str], int] = {}
        # When each deployment's last reconcile finished: the periodic looks (periodic.py) count any
        # reconcile as a look, so the rollout check does not repeat a nudge's work.
        self._reconciled_at: dict[tuple[str, str], float] = {}
        self._monotonic = monotonic

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """A deployment that is gone: what was kept for it, its children's own writes among them (the
        garbage collector deletes the children; a write kept for one would outlive it)."""
        if self._cache is not None:
            for kind in CHILD_KINDS:
                for child_name in _child_names(kind, name):
                    self._cache.forget(ref_of(kind), namespace, child_name)
        self._locks.pop((namespace, name), None)
        self._applied_replicas.pop((namespace, name), None)
        self._own_status.pop((namespace, name), None)
        self._own_version.pop((namespace, name), None)
        self._planned_version.pop((namespace, name), None)
        self._reconciled_at.pop((namespace, name), None)

    def _newest(self, key: tuple[str, str], watched: dict[str, Any]) -> dict[str, Any]:
        """The watched body, or our own last status write when the watch has not delivered it yet."""
        own = self._own_status.get(key)
        if own is None:
            return watched
        if version_number(own) > version_number(watched):
            return own
        del self._own_status[key]  # the watch caught up (or moved past it)
        return watched

    def rejected(self, body: dict[str, Any]) -> bool:
        """Pure: the spec is invalid or refused by the policy (a reconcile of it only writes status)."""
        spec, problems = validate_spec(body.get("spec"))
        return spec is None or bool(problems) or bool(violations(spec, self._settings.policy))

    def replicas_stale(self, body: dict[str, Any]) -> bool:
        """Pure check for the watch handler: would a reconcile now change the replica count? Against
        the count last applied, or, for a deployment not reconciled since the operator started,
        the replicas its status last reported (a wake written while the operator was down)."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if meta.get("deletionTimestamp"):
            return False
        status = body.get("status") or {}
        applied = self._applied_replicas.get(key, status.get("replicas"))
        if applied is None:
            return False  # never reconciled: its spec is unobserved, and that handles it
        spec, problems = validate_spec(body.get("spec"))
        if spec is None or problems or violations(spec, self._settings.policy):
            return False
        desired = status.get("desiredReplicas")
        decision = decide_replicas(spec, desired if spec.autoscaling_enabled else None)
        return decision.replicas != applied

    async def _serves_service_monitors(self) -> bool:
        """Whether the ServiceMonitor CRD is served, asked again every ``DISCOVERY_TTL_S``: by one
        reconcile, the others waiting for its answer (each of the 16 running asked for itself when
        the answer expired: 16 GETs every 5 minutes, most of a converged fleet's requests)."""
        async with self._discovery:
            now = self._monotonic()
            if self._service_monitors is None or now - self._service_monitors[0] > DISCOVERY_TTL_S:
                served = await self._client.serves(SERVICE_MONITOR.api_version, SERVICE_MONITOR.plural)
                self._service_monitors = (now, served)
            return self._service_monitors[1]

    async def reconcile(
        self,
        namespace: str,
        name: str,
        claimants: Claimants | None = None,
        body: dict[str, Any] | None = None,
        *,
        wait: bool = True,
        priority: Priority = Priority.CHANGE,
    ) -> Outcome:
        """``claimants``: served name -> the deployments claiming it (None: no check, one deployment).

        ``wait=False`` (the periodic looks, periodic.py): when this deployment is being reconciled
        already, or every one of the ``max_concurrent_reconciles`` slots is taken, return at once
        (``skipped``) rather than queue: the deployment stays due and is looked at on a later tick.

        ``body``: the object as the handler's watch saw it. A reconcile planned from it that finds
        nothing to write sends no request at all; one that applies children applies them from it
        (no read first: at 1,000 deployments that read was a ninth of the operator's requests and a
        round trip in every create); its status write is sent with the body's resourceVersion as a
        precondition, and on a 409 (the object moved on: another writer, or a newer spec still on
        its way through the watch) it reads the object afresh and plans again, applying what the
        newer spec changes. A body older than one this deployment was already planned from is read
        afresh instead. Without a body, the object is read first.

        ``priority``: the queue position when every slot is taken (slots.py). A rejected spec goes
        as ``STATUS`` whatever the caller says: nothing is rendered for it."""
        # The deployment's own lock first: a second trigger for the same deployment waits without
        # holding one of the slots.
        lock = self._lock((namespace, name))
        if not wait and (lock.locked() or self._running.locked()):
            return Outcome(skipped=True)
        # Only when it would wait: with a slot free the priority changes nothing, and the spec is
        # validated again inside anyway.
        if priority is not Priority.STATUS and body is not None and self._running.locked() and self.rejected(body):
            priority = Priority.STATUS
        async with lock, self._running.hold(priority):
            outcome = await self._reconcile_once(namespace, name, claimants, body)
            if outcome.gone:
                self.forget(namespace, name)
            else:
                self._reconciled_at[(namespace, name)] = self._monotonic()
            return outcome

    async def _reconcile_once(
        self, namespace: str, name: str, claimants: Claimants | None, body: dict[str, Any] | None
    ) -> Outcome:
        if body is not None:
            try:
                return await self._reconcile(namespace, name, claimants, self._newest((namespace, name), body))
            except _ReadAgain as e:
                again = await self._reconcile(namespace, name, claimants, None)
                again.applied[:0] = e.applied
                return again
        return await self._reconcile(namespace, name, claimants, None)

    def last_reconciled(self, key: tuple[str, str]) -> float | None:
        """When (``monotonic``) a reconcile of this deployment last finished, by any trigger."""
        return self._reconciled_at.get(key)

    def free_slots(self) -> int:
        return self._running.size - self._running.taken

    async def _not_applied(
        self,
        body: dict[str, Any],
        name: str,
        deployment_live: dict[str, Any] | None,
        outcome: Outcome,
        replica_reason: str,
        watched: bool,
    ) -> Outcome:
        """Status for a spec nothing was rendered or applied for (invalid, refused by policy, or its
        served name held by an older claimant): the children keep doing what they did."""
        observed = Observed(
            generation=body["metadata"].get("generation"),
            desired_replicas=None,
            replica_reason=replica_reason,
            autoscaling=False,
            deployment=DeploymentObservation.from_object(deployment_live) if deployment_live else None,
            invalid_spec=outcome.invalid,
            apply_error=None,
            endpoint=self._settings.router_endpoint,
            selector=names.selector_string(name),
            measured_cold_start_s=None,
            policy_violation=outcome.refused,
            name_conflict=outcome.conflict,
        )
        await self._write_status(body, observed, body.get("status") or {}, outcome, watched)
        return outcome

    async def _reconcile(
        self, namespace: str, name: str, claimants: Claimants | None, watched_body: dict[str, Any] | None
    ) -> Outcome:
        outcome = Outcome()
        watched = watched_body is not None
        body = watched_body if watched_body is not None else await self._client.get_object(INFD, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            outcome.gone = True
            return outcome
        meta = body["metadata"]
        key = (namespace, name)
        if watched and version_number(body) < self._planned_version.get(key, 0):
            raise _ReadAgain
        self._planned_version[key] = max(version_number(body), self._planned_version.get(key, 0))
        generation = meta.get("generation")
        live_status: dict[str, Any] = body.get("status") or {}
        owner = Owner(name=name, namespace=namespace, uid=meta.get("uid"))
        deployment_live = await self._reads.get_object(ref_of(DEPLOYMENT), namespace, names.engine_name(name))

        spec, problems = validate_spec(body.get("spec"))
        refused = violations(spec, self._settings.policy) if spec is not None and not problems else []
        if spec is None or problems or refused:
            # Nothing is rendered or applied: the children keep doing what they did.
            if refused:
                outcome.refused = "; ".join(str(v) for v in refused)
            else:
                outcome.invalid = "; ".join(str(p) for p in problems) or "spec is missing"
            reason = "spec is refused by the platform policy" if refused else "spec is invalid"
            return await self._not_applied(body, name, deployment_live, outcome, reason, watched)

        if claimants is not None:
            served = spec.served_name(name)
            older = holder(served, Claim(namespace, name, created_unix_s(body)), claimants(served))
            if older is not None:
                # Like a refused spec: nothing rendered or applied, so no new pods for a name the
                # router gives to the older claimant.
                outcome.conflict = conflict_message(served, older)
                return await self._not_applied(
                    body, name, deployment_live, outcome, "the served name is another deployment's", watched
                )

        autoscaling = spec.autoscaling_enabled
        decision = decide_replicas(spec, live_status.get("desiredReplicas") if autoscaling else None)
        # The pin is decided before the children are rendered: a reset (spec.model changed) reaches
        # its ConfigMap before the Deployment's new pods start, and a new pin is written in this pass.
        measured, report = await self._measure_cold_start(namespace, name, deployment_live, pod_spec_hash(spec))
        live_pin = await self._reads.get_object(ref_of(CONFIGMAP), namespace, names.pin_configmap_name(name))
        pin = decide_pin(spec, pin_from_configmap(live_pin), report.model_digest if report else None)
        children = render_children(
            owner,
            spec,
            decision.replicas,
            self._settings,
            service_monitor=await self._serves_service_monitors(),
            pin=pin.pin,
        )
        pending: list[tuple[ChildKind, dict[str, Any], str]] = []
        for child in children:
            kind = kind_of(child)
            child_name = child["metadata"]["name"]
            if kind is DEPLOYMENT:
                live = deployment_live
            elif child_name == names.pin_configmap_name(name):
                live = live_pin
            else:
                live = await self._reads.get_object(ref_of(kind), namespace, child_name)
            difference = "(missing)" if live is None else first_difference(child, live)
            if difference is not None:
                pending.append((kind, child, difference))
        for wave in apply_waves(pending, lambda item: item[0]):
            applied = await self._apply_wave(wave, outcome)
            deployment_live = applied.get(DEPLOYMENT.kind, deployment_live)
            if outcome.apply_error is not None:
                break
        if outcome.apply_error is None:
            self._applied_replicas[(namespace, name)] = decision.replicas

        unready = await self._pods_while_unready(namespace, name, deployment_live, decision.replicas)
        pulls = None
        if unready and self._pull_progress is not None and self._settings.progress_pods_per_tick > 0:
            pulls = await self._pull_progress.read(unready)
        observed = Observed(
            generation=generation,
            desired_replicas=decision.replicas,
            replica_reason=decision.reason,
            autoscaling=autoscaling,
            deployment=DeploymentObservation.from_object(deployment_live) if deployment_live else None,
            invalid_spec=None,
            apply_error=outcome.apply_error,
            endpoint=self._settings.router_endpoint,
            selector=names.selector_string(name),
            measured_cold_start_s=measured.seconds if measured is not None else None,
            # Once pinned, every pod serves the pin (a launcher refuses any other digest).
            model_digest=pin.pin.digest or (measured.model_digest if measured is not None else None),
            pods=diagnose_pods(unready) if unready else None,
            pulls=pulls,
        )
        await self._write_status(body, observed, live_status, outcome, watched)
        return outcome

    async def _apply_wave(
        self, wave: list[tuple[ChildKind, dict[str, Any], str]], outcome: Outcome
    ) -> dict[str, dict[str, Any]]:
        """Apply one wave's children at once (one round trip, not one per child); the applied objects
        by kind. A refused child is reported in ``outcome.apply_error`` (resending it unchanged would
        fail again: the periodic resync tries at its calm pace); any other failure is raised once every
        request of the wave has ended, the ones that succeeded remembered."""
        results = await asyncio.gather(
            *(self._client.apply(ref_of(kind), child, field_manager=FIELD_MANAGER) for kind, child, _ in wave),
            return_exceptions=True,
        )
        applied: dict[str, dict[str, Any]] = {}
        failure: BaseException | None = None
        for (kind, child, difference), result in zip(wave, results, strict=True):
            child_name = child["metadata"]["name"]
            if isinstance(result, KubeRejected):
                if outcome.apply_error is None:
                    outcome.apply_error = f"{kind.kind} {child_name}: {result.detail}"
                log.warning("apply of %s/%s refused: %s", kind.kind, child_name, result)
            elif isinstance(result, BaseException):
                failure = failure or result
            else:
                outcome.applied.append(f"{kind.kind}/{child_name} ({difference})")
                if self._cache is not None:
                    self._cache.remember(ref_of(kind), result)
                applied[kind.kind] = result
        if failure is not None:
            raise failure
        return applied

    async def _pods_while_unready(
        self, namespace: str, name: str, deployment: dict[str, Any] | None, desired: int
    ) -> list[dict[str, Any]] | None:
        """The engine pods, read only while some wanted replica is not ready (a converged deployment
        costs no extra request): why they fail, and how far their weight pulls are."""
        if deployment is None or desired == 0:
            return None
        if int((deployment.get("status") or {}).get("readyReplicas") or 0) >= desired:
            return None
        try:
            pods = await self._reads.list_objects(PODS, namespace, names.selector_string(name))
        except KubeError as e:
            log.info("cannot list engine pods of %s/%s to say why they are not ready: %s", namespace, name, e)
            return None
        return pods

    async def _measure_cold_start(
        self, namespace: str, name: str, deployment: dict[str, Any] | None, spec_hash: str
    ) -> tuple[LauncherReport | None, LauncherReport | None]:
        """The newest Ready pod's report, and the newest Ready pod's built from the current spec
        (its spec-hash annotation): only the latter may pin a digest (operator/pin.py)."""
        if self._coldstart is None or self._settings.coldstart_pods_per_tick == 0 or deployment is None:
            return None, None
        if not ((deployment.get("status") or {}).get("readyReplicas") or 0):
            return None, None
        try:
            pods = await self._reads.list_objects(PODS, namespace, names.selector_string(name))
        except KubeError as e:
            # The figure is informative only; it must never hold up a reconcile.
            log.info("cannot list engine pods of %s/%s for the cold-start figure: %s", namespace, name, e)
            return None, None
        current = [
            pod
            for pod in pods
            if ((pod.get("metadata") or {}).get("annotations") or {}).get(names.SPEC_HASH_ANNOTATION) == spec_hash
        ]
        latest = await self._coldstart.latest(pods)
        return latest, (await self._coldstart.latest(current) if current else None)

    async def _write_status(
        self, body: dict[str, Any], observed: Observed, live_status: dict[str, Any], outcome: Outcome, watched: bool
    ) -> None:
        plan = plan_status(observed, live_status, self._clock())
        meta = body["metadata"]
        changed = first_difference(plan.status, live_status) is not None
        key = (meta["namespace"], meta["name"])
        holds_own = key in self._own_version and version_number(body) >= self._own_version[key]
        # Planned from a watched copy that may lag (another writer, or kopf's own patches): written
        # only if the object is still at that copy's version; when it has moved on (409), read it
        # and plan again. One request in the common case, where a read first cost two.
        precondition = None
        if watched and (changed or plan.transitions) and not holds_own:
            precondition = str(meta.get("resourceVersion") or "")
            if not changed or not precondition:
                raise _ReadAgain(outcome.applied)
        if changed:
            try:
                written = await self._client.patch_status(
                    INFD,
                    meta["namespace"],
                    meta["name"],
                    plan.status,
                    field_manager=FIELD_MANAGER,
                    resource_version=precondition,
                )
            except KubeNotFound:
                outcome.gone = True
                return
            except KubeConflict:
                if precondition is None:
                    raise
                raise _ReadAgain(outcome.applied) from None
            outcome.status_written = True
            if version_number(written):
                self._own_status[key] = dict(without_managed_fields(written))
                self._own_version[key] = version_number(written)
        for transition in plan.transitions:
            cond = transition.condition
            message = f"{cond.type} is {cond.status}: {cond.message}"
            self._post_event(_object_ref(body), type=transition.event_type, reason=cond.reason, message=message)
            outcome.events.append(f"{transition.event_type} {cond.reason}")


def _child_names(kind: ChildKind, name: str) -> tuple[str, ...]:
    if kind.kind == "ConfigMap":
        return names.spec_configmap_name(name), names.pin_configmap_name(name)
    if kind.kind == "PodDisruptionBudget":
        return (names.pdb_name(name),)
    return (names.engine_name(name),)
