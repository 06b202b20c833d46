"""The Kubernetes Pod Security Standards, ``baseline`` and ``restricted`` profiles (``latest``),
as a pure check of a pod spec: what the PodSecurity admission controller would refuse in a
namespace labelled ``pod-security.kubernetes.io/enforce: restricted``.

Written from https://kubernetes.io/docs/concepts/security/pod-security-standards/ (Kubernetes
1.32) because the test apiserver (1.20) predates PodSecurity admission and no offline checker
of it is installed here. Each violation names the field, as the admission message does.

Limitations: checks a pod spec (or a template's) as written; a field the API server would
default (e.g. a seccomp profile from the kubelet) counts as unset, as PodSecurity counts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["restricted_violations"]

#: Capabilities the baseline profile allows to add.
_BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
#: Sysctls the baseline profile allows.
_SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
#: Volume types the restricted profile allows.
_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def _containers(spec: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out = []
    for key in ("initContainers", "containers", "ephemeralContainers"):
        out += [(f"{key}[{c.get('name', i)}]", c) for i, c in enumerate(spec.get(key) or [])]
    return out


def _seccomp_type(ctx: Mapping[str, Any] | None) -> str | None:
    profile = (ctx or {}).get("seccompProfile") or {}
    kind = profile.get("type")
    return str(kind) if kind is not None else None


def restricted_violations(
    spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> list[str]:
    """Every rule of the baseline and restricted profiles that ``spec`` (a PodSpec) breaks.

    Args:
        spec: the pod spec (``Pod.spec`` or a template's ``spec``).
        annotations: the pod's annotations (AppArmor before 1.30 lives there).

    Returns:
        One line per violation, naming the field; empty when the pod passes ``restricted``.
    """
    bad: list[str] = []
    pod_ctx: Mapping[str, Any] = spec.get("securityContext") or {}
    # --- baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            bad.append(f"spec.{field}=true")
    if (pod_ctx.get("windowsOptions") or {}).get("hostProcess"):
        bad.append("spec.securityContext.windowsOptions.hostProcess=true")
    for vol in spec.get("volumes") or []:
        types = set(vol) - {"name"}
        if "hostPath" in types:
            bad.append(f"volumes[{vol.get('name')}].hostPath")
        elif not types <= _VOLUMES:  # restricted
            bad.append(f"volumes[{vol.get('name')}]: type {sorted(types)} not allowed")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl.get("name") not in _SAFE_SYSCTLS:
            bad.append(f"spec.securityContext.sysctls[{sysctl.get('name')}]")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            bad.append(f"annotation {key}={value}")
    if _seccomp_type(pod_ctx) == "Unconfined":
        bad.append("spec.securityContext.seccompProfile.type=Unconfined")
    # --- restricted, pod level
    pod_non_root = pod_ctx.get("runAsNonRoot") is True
    pod_seccomp = _seccomp_type(pod_ctx) in ("RuntimeDefault", "Localhost")
    if pod_ctx.get("runAsUser") == 0:
        bad.append("spec.securityContext.runAsUser=0")
    for name, ctr in _containers(spec):
        ctx: Mapping[str, Any] = ctr.get("securityContext") or {}
        where = f"{name}.securityContext"
        # baseline
        if ctx.get("privileged"):
            bad.append(f"{where}.privileged=true")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{where}.windowsOptions.hostProcess=true")
        for port in ctr.get("ports") or []:
            if port.get("hostPort"):
                bad.append(f"{name}.ports[{port.get('name', '')}].hostPort={port['hostPort']}")
        if ctx.get("procMount", "Default") != "Default":
            bad.append(f"{where}.procMount={ctx['procMount']}")
        se = ctx.get("seLinuxOptions") or pod_ctx.get("seLinuxOptions") or {}
        if se.get("type", "") not in _SELINUX_TYPES or se.get("user") or se.get("role"):
            bad.append(f"{where}.seLinuxOptions={dict(se)}")
        if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append(f"{where}.appArmorProfile.type=Unconfined")
        caps = ctx.get("capabilities") or {}
        added = set(caps.get("add") or [])
        if added - _BASELINE_CAPS:
            bad.append(f"{where}.capabilities.add={sorted(added - _BASELINE_CAPS)}")
        # restricted
        if ctx.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}.allowPrivilegeEscalation must be false")
        if ctx.get("runAsNonRoot") is False or not (pod_non_root or ctx.get("runAsNonRoot")):
            bad.append(f"{where}.runAsNonRoot must be true (here or in spec.securityContext)")
        if ctx.get("runAsUser") == 0:
            bad.append(f"{where}.runAsUser=0")
        kind = _seccomp_type(ctx)
        if kind == "Unconfined" or (kind is None and not pod_seccomp):
            bad.append(
                f"{where}.seccompProfile.type must be RuntimeDefault or Localhost "
                "(here or in spec.securityContext)"
            )
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{where}.capabilities.drop must contain ALL")
        if added - {"NET_BIND_SERVICE"}:
            bad.append(f"{where}.capabilities.add may only hold NET_BIND_SERVICE")
    return bad
