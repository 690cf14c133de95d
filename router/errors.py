"""The router's error tree, following how a request fails. Each error knows the HTTP answer it becomes;
the proxy translates them once, at its boundary."""

from __future__ import annotations


class RouterError(Exception):
    """A request the router answers itself, with ``status``, an OpenAI-style ``kind`` (the body's
    ``type``), a string ``code`` or None, the request field at fault (``param``) and a reason."""

    status = 500
    kind = "internal_error"
    code: str | None = None

    def __init__(self, reason: str, *, retry_after_s: int | None = None, param: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.param = param
        # Seconds the request was held waiting for a replica (its answer's X-Kvfleet-Cold-Start); None: not held.
        self.held_s: float | None = None


class BadRequestError(RouterError):
    """The request itself is wrong (malformed JSON, no model, wrong field types): 400."""

    status = 400
    kind = "invalid_request_error"


class ClientNamespaceError(RouterError):
    """Client scoping is on and the request carries no single valid namespace header (it did not come
    through the authenticating gateway that sets it): 403, before any model is looked up."""

    status = 403
    kind = "permission_error"
    code = "client_namespace_required"


class PayloadTooLargeError(RouterError):
    """The body is over the router's size limit: 413 (refused before it is read whole)."""

    status = 413
    kind = "request_too_large"
    code = "request_too_large"


class ModelNotFoundError(RouterError):
    """No deployment serves the requested model: 404."""

    status = 404
    kind = "model_not_found"
    code = "model_not_found"

    def __init__(self, reason: str, *, retry_after_s: int | None = None, param: str | None = "model") -> None:
        super().__init__(reason, retry_after_s=retry_after_s, param=param)


class QueueFullError(RouterError):
    """No replica is ready and the model's hold queue is at maxQueue: 429."""

    status = 429
    kind = "queue_full"
    code = "queue_full"


class QueueTimeoutError(RouterError):
    """A held request waited maxQueueWaitSeconds without a replica turning ready: 503."""

    status = 503
    kind = "no_replica_ready"
    code = "no_replica_ready"


class ColdStartingError(RouterError):
    """The model has no ready replica and its wake is expected to take longer than the request may be
    held (a request that cannot be sent progress): 503 at once, with Retry-After from the estimate."""

    status = 503
    kind = "model_starting"
    code = "model_starting"


class UpstreamError(RouterError):
    """Every attempt failed before the first response byte (refused, reset, 503 from draining): 502."""

    status = 502
    kind = "upstream_unavailable"
    code = "upstream_unavailable"


class UpstreamBusyError(RouterError):
    """Every connection the router may hold to the picked replica stayed in use for pool_wait_timeout_s:
    503 with Retry-After. Not retried elsewhere: the wait already took the time a retry would have."""

    status = 503
    kind = "upstream_busy"
    code = "upstream_busy"


class ReplicaFailure(Exception):
    """The replica failed one attempt (not the client, not the router's own refusal): a lease whose block
    ends with one counts a failure towards ejecting the replica (``replica_lease.ReplicaLease``)."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(f"{replica_id}: {reason}")
        self.replica_id = replica_id
        self.reason = reason


class UpstreamAttemptError(ReplicaFailure):
    """One attempt on one replica failed before any byte reached the client, so it may be retried."""


class StreamBrokenError(ReplicaFailure):
    """The replica broke an answer after bytes of it reached the client (``error``: how): the request is
    committed, so it is continued elsewhere (a stream) or ends visibly broken, never retried whole."""

    def __init__(self, replica_id: str, error: Exception) -> None:
        super().__init__(replica_id, repr(error))
        self.error = error


class GatewayTimeoutError(RouterError):
    """The replica accepted the request but sent no response headers in time: 504 (not retried, the
    replica may still be working on it)."""

    status = 504
    kind = "upstream_timeout"
    code = "upstream_timeout"
