"""kvfleet.kube's one error tree, from real HTTP answers (tests/support/watch_api.py answers each
scripted status as kube-apiserver does: a Status object with its reason and message)."""

from __future__ import annotations

import pytest
from support.watch_api import WatchApi

from kvfleet.free_port import pick_free_port
from kvfleet.kube import (
    KubeClient,
    KubeConflict,
    KubeError,
    KubeGone,
    KubeNotFound,
    KubeRejected,
    KubeUnavailable,
    Ref,
)

IDS = "/apis/kvfleet.io/v1alpha1/namespaces/team/inferencedeployments"


# status -> (the class callers catch, retryable): kvfleet/kube/errors.py says why for 401, 409, 5xx.
TREE = {
    400: (KubeRejected, False),
    401: (KubeError, False),
    403: (KubeRejected, False),
    404: (KubeNotFound, False),
    405: (KubeRejected, False),
    409: (KubeConflict, False),
    410: (KubeGone, False),
    415: (KubeRejected, False),
    422: (KubeRejected, False),
    429: (KubeError, True),
    500: (KubeError, True),
    503: (KubeError, True),
}


@pytest.mark.parametrize("status", sorted(TREE))
async def test_each_status_maps_to_one_kind_of_error(api: WatchApi, status: int) -> None:
    kind, retryable = TREE[status]
    async with KubeClient.for_server(api.url, timeout_s=5) as client:
        api.fail_next(status)
        with pytest.raises(KubeError) as caught:
            await client.get(IDS)
    error = caught.value
    assert type(error) is kind
    assert (error.status, error.retryable) == (status, retryable)
    assert error.detail == f"scripted {status}"  # the API server's own message, for status and logs
    assert error.reason is not None and error.reason[0].isupper()  # its StatusReason (Invalid, Conflict, ...)
    assert str(error) == f"GET {IDS}: HTTP {status} scripted {status}"


async def test_no_answer_is_unavailable_and_retryable() -> None:
    async with KubeClient.for_server(f"http://127.0.0.1:{pick_free_port()}", timeout_s=2) as client:
        with pytest.raises(KubeUnavailable, match=r"Cannot connect to host 127\.0\.0\.1") as caught:
            await client.get(IDS)
    assert caught.value.status is None and caught.value.retryable


async def test_verbs_by_resource_type_read_absence_as_none_or_false(api: WatchApi) -> None:
    """A missing object is an answer, not an error, for the verbs the reconciler branches on."""
    ids = Ref("kvfleet.io/v1alpha1", "inferencedeployments")
    assert ids.item("team", "x", "status") == IDS + "/x/status"
    assert Ref("v1", "pods").collection(None) == "/api/v1/pods"
    async with KubeClient.for_server(api.url, timeout_s=5) as client:
        api.fail_next(404)
        assert await client.get_object(ids, "team", "x") is None
        api.fail_next(404)
        assert await client.serves("monitoring.coreos.com/v1", "servicemonitors") is False
        api.fail_next(503)
        with pytest.raises(KubeError) as caught:
            await client.get_object(ids, "team", "x")  # only 404 is absence: the rest still raises
    assert caught.value.retryable
