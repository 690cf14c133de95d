"""Where the API server is and who we are to it: lightkube's configuration, loaded one way for every
component (the operator's kopf login is built from the same, ``kvfleet.kube.kopf_login``)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from lightkube.config.kubeconfig import DEFAULT_KUBECONFIG, KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError

from kvfleet.kube.errors import KubeError


def load_config(kubeconfig: str | None = None, context: str | None = None) -> SingleConfig:
    """The in-cluster service account when running in a pod and no kubeconfig or context is named;
    else the kubeconfig (``kubeconfig``, else the first file in ``$KUBECONFIG``, else ~/.kube/config)."""
    if kubeconfig is None and context is None:
        try:
            in_pod = KubeConfig.from_service_account().get()
        except (ConfigError, KeyError):
            in_pod = None  # not in a pod (no token, or no KUBERNETES_SERVICE_HOST): the kubeconfig
        if in_pod is not None:
            return in_pod
    path = kubeconfig or (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or DEFAULT_KUBECONFIG
    try:
        config = KubeConfig.from_file(path).get(context)
    except (ConfigError, OSError, KeyError, TypeError, ValueError) as e:
        raise KubeError(f"kubeconfig {path}: {e}") from e
    if config is None:
        raise KubeError(f"kubeconfig {path}: no context")
    user = config.user
    if user is not None and user.token_file and not Path(user.token_file).is_absolute():
        # kubectl reads a relative tokenFile from the kubeconfig's folder; lightkube from the cwd.
        config = config._replace(user=msgspec.structs.replace(user, token_file=str(config.abs_file(user.token_file))))
    return config


def server_config(url: str) -> SingleConfig:
    """A plain server URL and no credentials (a local emulator, ``kubectl proxy``)."""
    config = KubeConfig.from_one(cluster=Cluster(server=url), user=User()).get()
    assert config is not None
    return config
