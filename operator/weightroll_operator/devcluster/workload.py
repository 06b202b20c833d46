"""The chart's example vLLM workload, sized for tiny CPU models on a simulated cluster.

Shared by the e2e tests and ``weightroll demo --cluster`` so both install exactly the same
workload: ``replicas`` pods of the chart's ``workloadExample`` Deployment, booting the model at
``/models/<boot_version>`` (the checkpoint claim, see :mod:`.kubelet`), with an agent that knows
the boot source and version.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SERVED_MODEL", "TOKEN_SECRET", "WORKLOAD", "workload_values"]

#: Name of the chart's example workload (its Deployment and pod name prefix).
WORKLOAD = "vllm-example"
#: The token Secret the example workload creates and the WeightUpdate refers to.
TOKEN_SECRET = "vllm-example-weightroll-token"
#: Model name the tiny vLLM servers answer to.
SERVED_MODEL = "tiny"


def workload_values(boot_version: str, token: str, replicas: int = 3) -> dict[str, Any]:
    """Helm values that enable the example workload on tiny bf16 models (eager, 256 tokens)."""
    return {
        "rbac": {"agentTokenSecretNames": [TOKEN_SECRET]},
        "workloadExample": {
            "enabled": True,
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
