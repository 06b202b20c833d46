"""A failed API call or kubeconfig in kubectl's words (issue 31 item 2), never a library's repr:
the same failures kubectl users know, built from our side only."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest
from weightroll_operator.errors import KubeUnavailable
from weightroll_operator.k8s.client import KubeConfig
from weightroll_operator.k8s.describe import kubeconfig_line, unreachable_line

SERVER = "https://10.0.0.1:6443"


def _failed(cause: BaseException | None, status: int = 0) -> KubeUnavailable:
    error = KubeUnavailable(status, "GET /apis: ClientConnectorError(ConnectionKey(...))")
    error.__cause__ = cause
    return error


def _cert_error() -> ssl.SSLCertVerificationError:
    error = ssl.SSLCertVerificationError(1, "certificate verify failed")
    error.verify_message = "self-signed certificate in certificate chain"
    return error


@pytest.mark.parametrize(
    ("cause", "status", "line"),
    [
        (
            ConnectionRefusedError(111, "Connect call failed"),
            0,
            "The connection to the server 10.0.0.1:6443 was refused - did you specify the right "
            "host or port?",
        ),
        (
            socket.gaierror(-2, "Name or service not known"),
            0,
            "Unable to connect to the server: dial tcp: lookup 10.0.0.1: no such host",
        ),
        (
            TimeoutError(),
            0,
            "Unable to connect to the server 10.0.0.1:6443: dial tcp 10.0.0.1:6443: i/o timeout",
        ),
        (
            _cert_error(),
            0,
            "Unable to connect to the server 10.0.0.1:6443: x509: self-signed certificate in "
            "certificate chain (check the kubeconfig's certificate-authority for this cluster)",
        ),
        (None, 302, "Unable to connect to the server 10.0.0.1:6443: it answered with a redirect"),
        (None, 200, "Unable to connect to the server 10.0.0.1:6443: it answered HTTP 200 with"),
    ],
)
def test_unreachable_in_kubectls_words(cause: BaseException | None, status: int, line: str) -> None:
    said = unreachable_line(_failed(cause, status), SERVER)
    assert said.startswith(line)
    assert "ConnectionKey" not in said and "\n" not in said


def test_a_cause_deep_in_the_chain_is_found() -> None:
    outer = OSError("wrapped")
    outer.__cause__ = ConnectionRefusedError(111, "refused")
    assert "was refused" in unreachable_line(_failed(outer), SERVER)


def _kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "config"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: ctx\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: ctx, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )
    return path


def _load_error(kubeconfig: str | None, context: str | None) -> Exception:
    with pytest.raises(Exception) as caught:
        KubeConfig.load(kubeconfig, context)
    return caught.value


def test_a_missing_context_is_named_as_kubectl_does(tmp_path: Path) -> None:
    config = str(_kubeconfig(tmp_path))
    line = kubeconfig_line(_load_error(config, "nope"), config, "nope")
    assert line == 'context "nope" does not exist (kubectl config get-contexts lists them)'


def test_a_missing_kubeconfig_file_is_named(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent")
    line = kubeconfig_line(_load_error(absent, None), absent, None)
    assert line == f"stat {absent}: no such file or directory"


def test_an_empty_kubeconfig_says_how_to_give_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    line = kubeconfig_line(_load_error(str(empty), None), str(empty), None)
    assert line.startswith(f"no configuration has been provided in {empty}: pass --kubeconfig")
