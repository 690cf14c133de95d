"""kopf's login built from kvfleet.kube's configuration (kvfleet/kube/kopf_login.py): kopf and the
operator's KubeClient present one identity, and a new login reads rotated credentials."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kopf
import pytest
from click.testing import CliRunner
from support.kubeconfig import write_kubeconfig
from support.watch_api import WatchApi

from kvfleet.cli import cli
from kvfleet.kube import KubeClient, load_config
from kvfleet.kube.kopf_login import connection_info, login_handler

IDS = "/apis/kvfleet.io/v1alpha1/inferencedeployments"
EXEC_CREDENTIAL = {
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": {"token": "from-the-plugin"},
}


USERS: dict[str, dict[str, Any]] = {
    "token": {"token": "inline.token"},
    "relativeTokenFile": {"tokenFile": "token"},  # relative to the kubeconfig, as kubectl reads it
    "exec": {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": ["-c", f"print({json.dumps(json.dumps(EXEC_CREDENTIAL))})"],
        }
    },
    "basic": {"username": "alice", "password": "s3cret"},
}


@pytest.mark.parametrize("user", sorted(USERS))
async def test_kopf_is_handed_the_header_the_client_sends(api: WatchApi, tmp_path: Path, user: str) -> None:
    (tmp_path / "token").write_text("from.the.file\n")
    config = load_config(str(write_kubeconfig(tmp_path, api.url, USERS[user])))
    info = await connection_info(config)
    async with KubeClient(config, timeout_s=5) as client:
        await client.get(IDS)
    sent = api.requests[-1].authorization
    assert sent is not None and sent.split(" ")[0] in ("Bearer", "Basic")
    assert info.as_http_headers() == {"Authorization": sent}
    assert (info.server, info.default_namespace) == (api.url, "team")


async def test_a_new_login_reads_a_rotated_token(tmp_path: Path) -> None:
    """kopf logs in again after a 401 on its own calls: the handler loads the configuration afresh."""
    token = tmp_path / "token"
    token.write_text("first\n")
    path = write_kubeconfig(tmp_path, "https://127.0.0.1:6443", {"tokenFile": str(token)})
    login = login_handler(lambda: load_config(str(path)))
    first = await login(settings=kopf.OperatorSettings())
    token.write_text("second\n")
    again = await login(settings=kopf.OperatorSettings())
    assert (first.token, again.token) == ("first", "second")


async def test_tls_files_are_read_from_the_kubeconfigs_folder(tmp_path: Path) -> None:
    """Relative certificate paths are the kubeconfig's folder's (as kubectl and KubeClient read them),
    not the operator's working directory; inline data is handed over as it is."""
    user = {"client-certificate": "client.crt", "client-key": "client.key"}
    path = write_kubeconfig(tmp_path, "https://127.0.0.1:6443", user, {"certificate-authority": "ca.crt"})
    info = await connection_info(load_config(str(path)))
    assert (info.ca_path, info.certificate_path, info.private_key_path) == tuple(
        str(tmp_path / name) for name in ("ca.crt", "client.crt", "client.key")
    )
    assert info.scheme is None and info.token is None and not info.insecure
    inline = {"client-certificate-data": "Y2VydA==", "client-key-data": "a2V5"}
    path = write_kubeconfig(tmp_path, "https://127.0.0.1:6443", inline, {"insecure-skip-tls-verify": True})
    info = await connection_info(load_config(str(path)))
    assert (info.certificate_data, info.private_key_data, info.insecure) == ("Y2VydA==", "a2V5", True)


async def test_no_configuration_is_a_login_error_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    login = login_handler(lambda: load_config(str(missing)))
    with pytest.raises(kopf.LoginError, match=f"kubeconfig {missing}"):
        await login(settings=kopf.OperatorSettings())


def test_the_operator_without_credentials_exits_naming_the_kubeconfig(tmp_path: Path) -> None:
    """Not in a pod and no kubeconfig: `kvfleet operator run` says which file it tried, no traceback."""
    missing = tmp_path / "kubeconfig"
    result = CliRunner().invoke(cli, ["operator", "run"], env={"KUBECONFIG": str(missing)})
    assert result.exit_code == 1, result.output
    assert f"Error: kubeconfig {missing}:" in result.output
    assert "Traceback" not in result.output
