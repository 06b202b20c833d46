"""A JSON Patch (RFC 6902) applier for the ``add`` operations admission webhooks answer with.

Only ``add`` (the injection webhook emits nothing else); anything else raises, so a test notices
if the webhook ever starts to replace or remove what a pod's owner wrote.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any


def apply_patch(document: Mapping[str, Any], ops: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``document`` with ``ops`` applied (a copy; the input is not changed)."""
    doc: dict[str, Any] = copy.deepcopy(dict(document))
    for op in ops:
        if op["op"] != "add":
            raise ValueError(f"unexpected JSON Patch operation {op['op']!r}")
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(op["value"])
        if isinstance(target, list):
            if last == "-":
                target.append(value)
            else:
                target.insert(int(last), value)
        else:
            if last in target:
                raise ValueError(f"add at {op['path']} would replace an existing member")
            target[last] = value
    return doc
