"""The one error tree of kvfleet's Kubernetes calls, mapped once from an HTTP answer (``error_for``).

It follows how a request fails, as httpx's does: no answer at all (``KubeUnavailable``, and
``KubeUnreachable`` when not even a connection was made), or an answer with an error status, where
the statuses a caller acts on have a class each (404, 409, 410, and ``KubeRejected`` for what the
server refused to accept). The operator, the router and the autoscaler all catch these.

Where the three callers once disagreed, decided here once:

- **401** is not retryable. The client's credentials that can change (a service account's
  ``tokenFile`` rotated by the kubelet, an exec plugin's short-lived token) are re-read by the
  client on a 401 and the request sent once more (lightkube's auth flow), so a 401 that reaches a
  caller is the server refusing fresh credentials: a person must fix them. It is not
  ``KubeRejected`` either (the request itself was fine). Loops that retry every failure anyway
  (a watch, the operator's handlers through ``kopf.TemporaryError``, the autoscaler's tick) still
  try again at their own pace.
- **5xx and 429** are retryable: the API server restarting, etcd electing a leader, priority and
  fairness shedding load heal by themselves; a back-off (at least the server's Retry-After) waits.
- **409** is ``KubeConflict`` and not retryable as sent: the same body with the same
  resourceVersion precondition fails again. The caller reads fresh state first (leader election
  counts it as a lost race; the operator's reconcile starts over from a fresh read).
"""

from __future__ import annotations

MAX_ERROR_CHARS = 500
REJECTED_STATUSES = frozenset({400, 403, 405, 415, 422})
"""Bad request, forbidden, method not allowed, unsupported media type, invalid: resending the same
request will not help."""


class KubeError(Exception):
    """The API server refused a request or could not be reached.

    ``status``: the HTTP status (None when no answer came); ``retry_after_s``: the server's
    Retry-After, when it sent one; ``reason`` and ``detail``: the ``reason`` and ``message`` of the
    server's Status object (e.g. ``Invalid`` and which field), when it sent one."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        retry_after_s: float | None = None,
        *,
        reason: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.detail = detail if detail is not None else message

    @property
    def retryable(self) -> bool:
        """No answer, 429 or 5xx heal by themselves; every other status needs a change first (this
        module's docstring says why 401 and 409 are not retryable)."""
        return self.status is None or self.status == 429 or self.status >= 500


class KubeNotFound(KubeError):
    """404: the object (or its resource type) does not exist."""


class KubeConflict(KubeError):
    """409: already exists, or the resourceVersion precondition failed."""


class KubeGone(KubeError):
    """410: the resourceVersion asked for is older than the API server keeps (list again)."""


class KubeRejected(KubeError):
    """400/403/405/415/422: the server refused what was sent; sending it again will not help."""


class KubeUnavailable(KubeError):
    """No answer: connection refused or reset, timeout, TLS failure, unreadable credentials."""


class KubeUnreachable(KubeUnavailable):
    """No connection could be made at all (refused, connect timeout): nothing was missed meanwhile
    that a resumed watch would not replay."""


_BY_STATUS: dict[int, type[KubeError]] = {
    404: KubeNotFound,
    409: KubeConflict,
    410: KubeGone,
    **dict.fromkeys(REJECTED_STATUSES, KubeRejected),
}


def error_for(
    status: int,
    message: str,
    retry_after_s: float | None = None,
    *,
    reason: str | None = None,
    detail: str | None = None,
) -> KubeError:
    """The error for an HTTP error status (the one place a status becomes a class)."""
    kind = _BY_STATUS.get(status, KubeError)
    return kind(message[:MAX_ERROR_CHARS], status, retry_after_s, reason=reason, detail=detail)
