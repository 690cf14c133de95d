"""kvfleet's one Kubernetes layer: the operator's, the router's and the autoscaler's API calls.

- ``config``: where the API server is and who we are (lightkube's loader: in-cluster service
  account, kubeconfig contexts, tokens, ``tokenFile``, exec plugins, client certificates, TLS).
- ``errors``: the one error tree (``KubeError`` and its kinds), mapped once from an HTTP answer;
  its docstring decides 401, 409 and 5xx for every caller.
- ``client``: ``KubeClient``, one kept aiohttp connection pool per process (lightkube's TLS
  settings; ``credentials`` drives lightkube's auth flow for its header): requests by path, the
  verbs by resource type (``Ref``: get, list, server-side apply, status patch, delete, discovery),
  watch streams.
- ``ref``: ``Ref``, a resource type's apiVersion and plural, and the paths it gives (pure).
- ``watch``: ``ResourceWatch``, list once then watch with resourceVersion resume and bookmarks;
  410 Gone relists, every other failure resumes from the last version after a jittered back-off.
  Consumers get one call per changed object, never the whole store.
- ``backoff``: jittered exponential back-off that honours ``Retry-After`` (pure).
- ``credentials``: the ``Authorization`` header from lightkube's auth flow, renewed on a 401.
- ``kopf_login``: the operator's kopf login, built from the same ``config`` (one credentials source).

kopf keeps its own internal client for what kopf does itself (its watches, peering, finalizers,
progress annotations, Events): it logs in with what ``kopf_login`` hands it. Every call kvfleet
makes goes through ``KubeClient``.
"""

from kvfleet.kube.client import KubeClient
from kvfleet.kube.config import load_config, server_config
from kvfleet.kube.errors import (
    KubeConflict,
    KubeError,
    KubeGone,
    KubeNotFound,
    KubeRejected,
    KubeUnavailable,
    KubeUnreachable,
)
from kvfleet.kube.ref import Ref

__all__ = [
    "KubeClient",
    "KubeConflict",
    "KubeError",
    "KubeGone",
    "KubeNotFound",
    "KubeRejected",
    "KubeUnavailable",
    "KubeUnreachable",
    "Ref",
    "load_config",
    "server_config",
]
