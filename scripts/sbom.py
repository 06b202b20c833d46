#!/usr/bin/env python3
"""A CycloneDX 1.5 SBOM (JSON) of one image's Python packages, from its hash-locked requirements.

Usage: ``python3 scripts/sbom.py TARGET requirements/TARGET.lock > sbom/TARGET.cdx.json``
(``scripts/lock.sh`` runs it for both images). Every locked package becomes a ``library``
component with its PyPI purl and every SHA-256 the lock accepts; weightroll itself is the
described component. The output is deterministic (no timestamp; the serial number is derived
from the lock's content), so ``tests/charts/test_dockerfile.py`` checks it is up to date.
Standard library only: it runs in any Python, before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tomllib
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def parse_lock(text: str) -> list[tuple[str, str, list[str]]]:
    """``(name, version, sha256s)`` per requirement of a pip-compile/uv lock, in file order.

    Raises:
        ValueError: a requirement is not pinned with ``==`` or carries no hash.
    """
    out: list[tuple[str, str, list[str]]] = []
    for block in re.split(r"\n(?=\S)", text):
        head = block.strip()
        if not head or head.startswith("#"):
            continue
        match = _PIN.match(head)
        if match is None:
            raise ValueError(f"not pinned with ==: {head.splitlines()[0]!r}")
        hashes = _HASH.findall(block)
        if not hashes:
            raise ValueError(f"no --hash for {match.group(1)}")
        out.append((match.group(1).lower().replace("_", "-"), match.group(2), hashes))
    return out


def sbom(target: str, lock_text: str) -> dict[str, object]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    serial = uuid.uuid5(uuid.NAMESPACE_URL, hashlib.sha256(lock_text.encode()).hexdigest())
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{serial}",
        "version": 1,
        "metadata": {
            "tools": {"components": [{"type": "application", "name": "scripts/sbom.py"}]},
            "component": {
                "type": "container",
                "name": f"weightroll-{target}",
                "version": project["version"],
                "bom-ref": f"weightroll-{target}",
            },
        },
        "components": [
            {
                "type": "library",
                "bom-ref": f"pkg:pypi/{name}@{version}",
                "name": name,
                "version": version,
                "purl": f"pkg:pypi/{name}@{version}",
                "hashes": [{"alg": "SHA-256", "content": h} for h in hashes],
            }
            for name, version, hashes in parse_lock(lock_text)
        ],
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    target, lock = argv
    json.dump(sbom(target, Path(lock).read_text()), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
