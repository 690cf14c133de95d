"""The operator's kopf login, built from ``kvfleet.kube.config``: one credentials source for kopf's own
client and the operator's ``KubeClient``.

kopf's default login goes through the ``kubernetes`` client library, a second loader of the same
kubeconfig with rules of its own. Here kopf is handed what lightkube loaded instead: the server and
TLS settings as they are, and the ``Authorization`` header that lightkube's auth flow would send
(a token, a re-read ``tokenFile``, an exec plugin's token, basic auth), so kopf and ``KubeClient``
always present the same identity. kopf calls the login handler again when its own calls get a 401;
the handler then loads the configuration afresh (a rotated token is read anew).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import kopf
from lightkube.config.kubeconfig import SingleConfig

from kvfleet.kube.credentials import authorization_header
from kvfleet.kube.errors import KubeError


async def connection_info(config: SingleConfig, *, trust_env: bool = False) -> kopf.ConnectionInfo:
    """kopf's ``ConnectionInfo`` for ``config``: the same server, CA, client certificate and header."""
    cluster, user = config.cluster, config.user
    scheme = token = None
    header = await authorization_header(config)
    if header:
        scheme, _, token = header.partition(" ")
    return kopf.ConnectionInfo(
        server=cluster.server,
        ca_path=str(config.abs_file(cluster.certificate_auth)) if cluster.certificate_auth else None,
        ca_data=cluster.certificate_auth_data,
        insecure=cluster.insecure or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=str(config.abs_file(user.client_cert)) if user and user.client_cert else None,
        certificate_data=user.client_cert_data if user else None,
        private_key_path=str(config.abs_file(user.client_key)) if user and user.client_key else None,
        private_key_data=user.client_key_data if user else None,
        default_namespace=config.context.namespace,
        trust_env=trust_env,
    )


def login_handler(load: Callable[[], SingleConfig]) -> Callable[..., Awaitable[kopf.ConnectionInfo]]:
    """A ``@kopf.on.login`` handler that loads the configuration with ``load`` each time kopf logs in."""

    async def login(*, settings: kopf.OperatorSettings, **_: object) -> kopf.ConnectionInfo:
        try:
            return await connection_info(load(), trust_env=settings.networking.trust_env)
        except KubeError as e:
            raise kopf.LoginError(str(e)) from e

    return login
