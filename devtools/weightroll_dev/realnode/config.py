"""The real node's files: directory layout, containerd, CNI and kubelet configuration.

Pure builders (text out, nothing started) so each workaround of ``../shared/design/real-node.md``
is visible in one place:

* containerd's CRI plugin with ``restrict_oom_score_adj = true``: root here lacks
  ``CAP_SYS_RESOURCE``, and runc fails every sandbox when the kubelet asks for a negative OOM
  score;
* a local pause image as ``sandbox_image`` (no registry is reachable);
* a bridge CNI network whose IPAM state lives in the node's directory; without a CNI config the
  runtime reports ``NetworkReady=false`` and the node stays NotReady;
* a kubelet on the cgroupfs driver that makes no iptables chains, opens no read-only port and
  keeps its root, certificates and volume plugins in the node's directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NODE_ADDRESS",
    "NODE_INTERFACE",
    "POD_SUBNET",
    "NodeLayout",
    "cni_config",
    "containerd_config",
    "kubelet_config",
]

#: The node's address: on one end of a veth pair whose both ends are inside the network
#: namespace (the kubelet refuses a loopback node IP); the namespace's default route points at
#: it, so a packet for any other address ends at the peer and is dropped there instead of
#: leaving the namespace.
NODE_INTERFACE = "wr-node0"
NODE_PEER = "wr-node1"
NODE_ADDRESS = "10.89.0.1"
NODE_PREFIX = 24
#: Pods' addresses, on the CNI bridge inside the namespace.
POD_SUBNET = "10.88.0.0/24"
CNI_BRIDGE = "wr-cni0"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Every path of one real node, all under ``root``."""

    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "node.json"

    @property
    def apiserver_run(self) -> Path:
        return self.root / "apiserver"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.containerd / "config.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_root(self) -> Path:
        return self.kubelet / "root"

    @property
    def kubelet_config(self) -> Path:
        return self.kubelet / "config.yaml"


def containerd_config(layout: NodeLayout, sandbox_image: str) -> str:
    """containerd 1.6 configuration (version 2) with root, state and sockets under ``layout``."""
    c = layout.containerd
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    return "\n".join(
        [
            "version = 2",
            f'root = "{c / "root"}"',
            f'state = "{c / "state"}"',
            # The opt plugin would create /opt/containerd on the host; nothing here uses it.
            'disabled_plugins = ["io.containerd.internal.v1.opt",'
            ' "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",'
            ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]",
            f'  address = "{layout.containerd_socket}"',
            "[ttrpc]",
            f'  address = "{layout.containerd_socket}.ttrpc"',
            "[debug]",
            f'  address = "{c / "debug.sock"}"',
            cri,
            f'  sandbox_image = "{sandbox_image}"',
            "  restrict_oom_score_adj = true",
            "  enable_selinux = false",
            "  disable_apparmor = true",
            f"{cri[:-1]}.cni]",
            '  bin_dir = "/usr/lib/cni"',
            f'  conf_dir = "{layout.cni_conf_dir}"',
            f"{cri[:-1]}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            f"{cri[:-1]}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            "",
        ]
    )


def cni_config(layout: NodeLayout) -> str:
    """A bridge network for the pods, with host-local IPAM state under ``layout``.

    No ``ipMasq`` and no ``portmap``: both would program iptables, and nothing leaves the
    namespace anyway.
    """
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": "weightroll",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": CNI_BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(layout.cni_ipam_dir),
                    },
                },
                {"type": "loopback"},
            ],
        },
        indent=2,
    )


def kubelet_config(layout: NodeLayout) -> str:
    """KubeletConfiguration for a node whose runtime, network and state are all local.

    Eviction thresholds are low: the machine's disk is shared with other work, and a node under
    disk pressure taints itself and refuses pods for reasons that have nothing to do with a test.
    """
    return "\n".join(
        [
            "apiVersion: kubelet.config.k8s.io/v1beta1",
            "kind: KubeletConfiguration",
            "cgroupDriver: cgroupfs",
            "failSwapOn: false",
            "makeIPTablesUtilChains: false",
            "readOnlyPort: 0",
            f"address: {NODE_ADDRESS}",
            "healthzBindAddress: 127.0.0.1",
            # The apiserver has no kubelet client certificate; the kubelet's port is reachable
            # only inside the namespace. Anonymous access lets `kubectl logs/exec` through.
            "authentication:",
            "  anonymous: {enabled: true}",
            "  webhook: {enabled: false}",
            "authorization: {mode: AlwaysAllow}",
            'resolvConf: ""',
            "evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}",
            "imageGCHighThresholdPercent: 100",
            "imageGCLowThresholdPercent: 99",
            "nodeStatusReportFrequency: 10s",
            "fileCheckFrequency: 1h",
            "",
        ]
    )
