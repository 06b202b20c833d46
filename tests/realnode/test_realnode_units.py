"""Pure parts of the real node (weightroll_dev.realnode): image archives, configuration, the
host footprint's comparison. Fast; no root, nothing started."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from weightroll_dev.realnode import host
from weightroll_dev.realnode.config import NodeLayout, cni_config, containerd_config
from weightroll_dev.realnode.images import TINY_IMAGE, tiny_layer, write_oci_archive
from weightroll_dev.realnode.pods import host_python_mounts


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        out = {}
        for m in tar:
            handle = tar.extractfile(m)
            assert handle is not None
            out[m.name] = handle.read()
        return out


def test_oci_archive_names_the_image_and_every_blob_matches_its_digest(tmp_path: Path) -> None:
    archive = write_oci_archive(tmp_path / "tiny.tar", TINY_IMAGE, tiny_layer(), ["/bin/sh"])
    files = _members(archive)
    index = json.loads(files["index.json"])
    (manifest_desc,) = index["manifests"]
    assert manifest_desc["annotations"]["io.containerd.image.name"] == TINY_IMAGE
    assert manifest_desc["platform"] == {"architecture": "amd64", "os": "linux"}
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(files["blobs/sha256/" + manifest_desc["digest"].split(":")[1]])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    layer = files["blobs/sha256/" + manifest["layers"][0]["digest"].split(":")[1]]
    # containerd unpacks only when the config's diff_id is the uncompressed layer's digest.
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]


def test_oci_archive_is_deterministic(tmp_path: Path) -> None:
    a = write_oci_archive(tmp_path / "a.tar", TINY_IMAGE, tiny_layer(), ["/bin/sh"])
    b = write_oci_archive(tmp_path / "b.tar", TINY_IMAGE, tiny_layer(), ["/bin/sh"])
    assert a.read_bytes() == b.read_bytes()


def test_tiny_layer_has_usr_merge_links() -> None:
    links = {e.path: e.target for e in tiny_layer() if e.kind == "symlink"}
    assert links == {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}


def test_containerd_config_keeps_everything_under_the_node_and_restricts_oom_scores() -> None:
    layout = NodeLayout(Path("/n"))
    text = containerd_config(layout, "weightroll.local/pause:3.2")
    assert "restrict_oom_score_adj = true" in text
    assert 'sandbox_image = "weightroll.local/pause:3.2"' in text
    assert 'address = "/n/containerd/containerd.sock"' in text
    assert 'conf_dir = "/n/cni/net.d"' in text


def test_cni_ipam_state_stays_under_the_node() -> None:
    plugins = json.loads(cni_config(NodeLayout(Path("/n"))))["plugins"]
    bridge = next(p for p in plugins if p["type"] == "bridge")
    assert bridge["ipam"]["dataDir"] == "/n/cni/ipam"
    assert bridge["ipMasq"] is False


def _footprint(**changes: object) -> host.Footprint:
    base: dict[str, object] = {
        "mounts": frozenset({"/"}),
        "netns": frozenset(),
        "links": frozenset({"lo"}),
        "addresses": frozenset(),
        "cgroups": frozenset(),
        "paths": frozenset(),
        "sysctls": (("kernel/panic", "1"),),
        "processes": frozenset(),
    }
    base.update(changes)
    return host.Footprint(**base)  # type: ignore[arg-type]


def test_footprint_difference_names_what_was_left_and_changed_settings() -> None:
    before = _footprint()
    after = _footprint(
        netns=frozenset({"cni-1"}),
        cgroups=frozenset({"/sys/fs/cgroup/cpu/kubepods"}),
        sysctls=(("kernel/panic", "10"),),
    )
    assert before.difference(after) == {
        "netns": ["cni-1"],
        "cgroups": ["/sys/fs/cgroup/cpu/kubepods"],
        "sysctls": ["kernel/panic=10"],
    }
    assert before.difference(_footprint()) == {}


def test_host_python_mounts_cover_interpreter_venv_and_checkout_once(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /opt/py/3.11/bin\nversion = 3.11.7\n")
    volumes, mounts = host_python_mounts(venv, tmp_path / "checkout")
    paths = [m["mountPath"] for m in mounts]
    assert paths[0] == "/usr" and "/opt/py/3.11" in paths
    assert str(venv) in paths and str(tmp_path / "checkout") in paths
    assert all(m["readOnly"] for m in mounts)
    assert [v["hostPath"]["path"] for v in volumes] == paths
    # A system interpreter under /usr needs no mount of its own.
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    _, mounts = host_python_mounts(venv, tmp_path / "checkout")
    assert [m["mountPath"] for m in mounts].count("/usr") == 1
    assert len(mounts) == 3
