"""The chart's example vLLM workload, sized for tiny CPU models on a simulated cluster.

Shared by the e2e tests and ``weightroll_dev demo --cluster`` so both install exactly the same
workload: ``replicas`` pods of the chart's ``workloadExample`` Deployment, booting the model at
``/models/<boot_version>`` (the checkpoint claim, see :mod:`.kubelet`), with an agent that knows
the boot source and version.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from weightroll_dev import checkout_pythonpath

__all__ = [
    "SERVED_MODEL",
    "TOKEN_SECRET",
    "WORKLOAD",
    "corrupt_tensor_file",
    "default_service_account",
    "engine_env",
    "pods_from_deployment",
    "workload_values",
]

#: Name of the chart's example workload (its Deployment and pod name prefix).
WORKLOAD = "vllm-example"
#: The token Secret the example workload creates and the WeightUpdate refers to.
TOKEN_SECRET = "vllm-example-weightroll-token"
#: Model name the tiny vLLM servers answer to.
SERVED_MODEL = "tiny"


def workload_values(
    boot_version: str, token: str, replicas: int = 3, inject: bool = False
) -> dict[str, Any]:
    """Helm values that enable the example workload on tiny bf16 models (eager, 256 tokens).

    ``inject``: the example carries only the ``weightroll.io/inject`` label (and annotations);
    the operator's webhook, which the dev cluster points at its local process, adds the rest.
    """
    values: dict[str, Any] = {
        # Opt-outs of the chart's defaults, because the demo runs `weightroll-operator` as a
        # local process, not the chart's Deployment: that process watches every namespace (so
        # the ClusterRole) and is given no agent CA (so plain HTTP; tests/e2e/test_agent_tls.py
        # turns agentTLS back on and hands the operator the CA).
        "operator": {"clusterWide": True},
        "agentTLS": {"enabled": False},
        "rbac": {"agentTokenSecretNames": [TOKEN_SECRET]},
        # The dev cluster routes no Service traffic (no kube-proxy, no endpoints): the API
        # server could not reach the chart's webhook Service. The cluster tests register the
        # webhook on loopback instead (tests/charts/test_webhook_cluster.py).
        "webhook": {"enabled": False},
        "workloadExample": {
            "enabled": True,
            # hand-written pieces unless `inject` (the webhook is off here unless then)
            "inject": False,
            "name": WORKLOAD,
            "replicas": replicas,
            "vllm": {
                "model": f"/models/{boot_version}",
                "extraArgs": [
                    f"--served-model-name={SERVED_MODEL}",
                    "--enforce-eager",
                    "--max-model-len=256",
                    "--max-num-seqs=4",
                    "--dtype=bfloat16",
                    "--seed=0",
                ],
            },
            "agent": {
                "extraArgs": [
                    f"--initial-source=file:///models/{boot_version}",
                    f"--initial-version={boot_version}",
                    "--watch-interval=1",
                ]
            },
            "tokenSecret": {"token": token},
        },
    }
    if inject:
        # Both webhooks registered by the chart (re-pointed to the local operator, bringup.py);
        # the boot weights through annotations, since agent arguments are not injected.
        values["webhook"] = {"enabled": True}
        example = values["workloadExample"]
        example["inject"] = True
        example["agent"] = {"extraArgs": []}
        example["initialWeights"] = {"version": boot_version}
    return values


def engine_env(boot_version: str) -> dict[str, str]:
    """The environment of the simulated pods' processes: vLLM CPU on a shared 2-core machine."""
    env = {
        **os.environ,
        "PYTHONPATH": checkout_pythonpath(),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Several servers share two cores: let the OS place their threads (the default binds
        # every server's OpenMP threads to core 0).
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # The boot version the extension reports (an image would set it in its env).
        "WEIGHTROLL_BOOT_VERSION": boot_version,
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def pods_from_deployment(
    deployment: Mapping[str, Any], names: Sequence[str], namespace: str
) -> list[dict[str, Any]]:
    """Play the ReplicaSet controller (the test apiserver has none): one pod per name from the
    Deployment's template."""
    template = deployment["spec"]["template"]
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": template["metadata"]["labels"],
                "annotations": template["metadata"].get("annotations") or {},
            },
            "spec": template["spec"],
        }
        for name in names
    ]


def corrupt_tensor_file(checkpoint: Path) -> Path:
    """Flip one byte of tensor data in the first ``*.safetensors`` file of ``checkpoint``.

    The file is replaced, never written in place: a pod's copy of the checkpoint volume is a
    hard link to the shared one, which must stay intact for the other pods. The replacement is
    atomic (a sibling renamed over it): a volume sync running meanwhile, which links missing
    files back in, never sees the name absent and so can never link the shared file there.
    """
    target = sorted(checkpoint.glob("*.safetensors"))[0]
    data = bytearray(target.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 16] ^= 0xFF
    tmp = target.with_name(f".{target.name}.corrupt")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, target)
    return target


def default_service_account(namespace: str) -> dict[str, Any]:
    """The ``default`` ServiceAccount of ``namespace``: the test apiserver runs no
    controller-manager to create it, and pods that name no ServiceAccount need it."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": namespace},
        "automountServiceAccountToken": False,
    }
