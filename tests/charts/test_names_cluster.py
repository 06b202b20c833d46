"""Issue 28 item 1 on a real kube-apiserver: a Secret name cannot walk into another namespace.

Reproduction: ``spec.agent.tokenSecretRef.name: ../../team-b/secrets/agent-token`` passed the
CRD (only ``minLength: 1``), the model and the webhook; the operator's client put it unquoted
into the path, the HTTP client resolved the dot segments and the operator read team-b's opted-in
token Secret for a WeightUpdate of team-a (then sent it to team-a's pods). Here the operator's
own client, with rights in both namespaces (`operator.clusterWide`, or both namespaces in
`operator.watchNamespaces`), is asked for that name: it must refuse before any request,
naming the field; and the API server itself must refuse to store such a WeightUpdate (the
CRD's schema).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml
from weightroll_operator.errors import InvalidSpec
from weightroll_operator.k8s.client import KubeApi, KubeConfig

from tests.harness.apiserver import REPO, KubeCluster, kubectl

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CRD = REPO / "crds" / "pre-1.25" / "weightupdates.weightroll.io.yaml"


def _apply(cluster: KubeCluster, obj: dict[str, Any], check: bool = True) -> Any:
    return kubectl(cluster, "apply", "-f", "-", input_=yaml.safe_dump(obj), check=check)


@pytest.mark.asyncio
async def test_a_token_secret_name_cannot_name_another_namespace(kube_cluster: KubeCluster) -> None:
    suffix = uuid.uuid4().hex[:6]
    team_a, team_b = f"team-a-{suffix}", f"team-b-{suffix}"
    for ns in (team_a, team_b):
        kubectl(kube_cluster, "create", "namespace", ns)
    _apply(
        kube_cluster,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "agent-token",
                "namespace": team_b,
                "labels": {"weightroll.io/agent-token": "true"},
            },
            "stringData": {"token": "team-b-token"},
        },
    )
    traversal = f"../../{team_b}/secrets/agent-token"
    api = KubeApi(KubeConfig.load(str(kube_cluster.kubeconfig)))
    try:
        # The control: these rights do read team-b's Secret when it is asked for by its name.
        assert await api.read_agent_token(team_b, "agent-token", "token") == "team-b-token"
        with pytest.raises(InvalidSpec, match=r"spec\.agent\.tokenSecretRef"):
            await api.read_agent_token(team_a, traversal, "token")
        for quoted in ("..%2F..%2F" + team_b, "agent-token/..", "%2e%2e"):
            with pytest.raises(InvalidSpec):
                await api.read_agent_token(team_a, quoted, "token")
        with pytest.raises(InvalidSpec):
            await api.read_agent_token(team_a, "agent-token", "../token")
    finally:
        await api.close()

    # The API server stores no such WeightUpdate: the CRD's schema refuses the name.
    kubectl(kube_cluster, "apply", "-f", str(CRD))
    kubectl(
        kube_cluster,
        "wait",
        "--for=condition=Established",
        "crd/weightupdates.weightroll.io",
        "--timeout=60s",
    )
    wu = {
        "apiVersion": "weightroll.io/v1alpha1",
        "kind": "WeightUpdate",
        "metadata": {"name": "steal", "namespace": team_a},
        "spec": {
            "selector": {"matchLabels": {"app": "llm"}},
            "version": "v2",
            "source": {"uri": "file:///models/v2"},
            "agent": {"tokenSecretRef": {"name": traversal}},
        },
    }
    proc = _apply(kube_cluster, wu, check=False)
    assert proc.returncode != 0, "the API server stored a WeightUpdate naming a path"
    assert "spec.agent.tokenSecretRef.name" in proc.stderr, proc.stderr
    wu["spec"]["agent"]["tokenSecretRef"]["name"] = "agent-token"
    _apply(kube_cluster, wu)  # the control: a name is stored
