"""The cluster admin's access: the kubeconfig written for it (credentials as file references,
nothing secret inline) and the few calls start-up makes with the admin certificate, over urllib
(no client library import on the CLI's path; the tests use kubectl and kubernetes for the rest)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .pki import Pki

ADMIN_CONTEXT = "kvfleet-dev"


def kubeconfig_document(server: str, ca_file: Path, user: dict[str, Any], *, name: str = ADMIN_CONTEXT) -> str:
    """A kubeconfig whose credentials are file references (nothing secret inline)."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    return yaml.safe_dump(doc, sort_keys=False)


def _ssl_context(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    return context


class AdminApi:
    """The few admin calls start-up needs, over urllib with the admin certificate (no client library
    import on the CLI's path; the tests use kubectl and kubernetes for everything else)."""

    def __init__(self, server: str, pki: Pki) -> None:
        self.server = server
        self._ssl = _ssl_context(pki)

    def call(self, method: str, path: str, body: Any = None, *, timeout_s: float = 10.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)  # noqa: S310 (https URL we built)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, context=self._ssl, timeout=timeout_s) as response:  # noqa: S310
                text = response.read().decode()
                return response.status, json.loads(text) if text.startswith(("{", "[")) else text
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text
