"""Generate the WeightUpdate field tables of ``docs/api.md`` from the pydantic models.

Run ``python tests/docs/api_reference.py --write`` after changing
``operator/weightroll_operator/api/v1alpha1.py``; ``tests/docs/test_api_reference.py`` fails when
the tables in ``docs/api.md`` differ from what the models generate, or when a field has no
description.

Type, default and the schema-level validation (bounds, patterns, enums, required) come from the
models' JSON schema, so they cannot drift. The *meaning* of each WeightUpdate field is its
attribute docstring in the models (``use_attribute_docstrings``): the same text is the CRD's
description and so what ``kubectl explain`` shows. The agent wire models
(``engine_agent/protocol/``) still keep their meanings here, in :data:`WIRE_MEANINGS`.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.api.crdgen import one_line

from engine_agent import protocol
from engine_agent.protocol import VERSION_PATTERN

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"

#: Table cell for "no default" / "no extra validation".
NONE = "-"
#: Objects whose fields get rows of their own; any other object is one row.
_RECURSE = frozenset({"SourceSpec", "StrategySpec", "DrainSpec", "PrefetchSpec", "AgentSpec"})

#: Table cell of a field without a description (the tests fail on it).
UNDOCUMENTED = "**undocumented**"


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Follow ``$ref`` and drop the ``null`` branch of an Optional; return (node, def name)."""
    node = dict(node)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            node = {**options[0], **rest}
    name = ""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        rest = {k: v for k, v in node.items() if k != "$ref"}
        node = {**defs[name], **rest}
    return node, name


def _type(node: Mapping[str, Any], name: str) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if name == "LabelSelector":
        return "label selector"
    if name == "SecretKeyRef":
        return "`{name, key}`"
    if name == "SourceSpec":
        return "`{uri, manifest}`"
    if name == "Verdict":
        return "`{committed, reasons}`"
    if "anyOf" in node:
        types = sorted(o.get("type", "?") for o in node["anyOf"])
        if types == ["integer", "string"]:
            return "int or string"
    pattern = node.get("pattern")
    if pattern == VERSION_PATTERN:
        return "version (label-value syntax)"
    if pattern == api.LABEL_KEY_PATTERN:
        return "label key"
    if node.get("type") == "array":
        return "list"
    return {"integer": "int", "boolean": "bool", "string": "string", "object": "object"}.get(
        node.get("type", ""), node.get("type", "?")
    )


def _validation(node: Mapping[str, Any], name: str) -> str:
    parts = []
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None and high is not None:
        parts.append(f"{low} to {high}")
    elif low is not None:
        parts.append(f"≥ {low}")
    elif high is not None:
        parts.append(f"≤ {high}")
    if node.get("minLength"):
        parts.append("non-empty")
    if name == "SecretKeyRef":
        parts.append("`name` non-empty; `key` defaults to `token`")
    return ", ".join(parts) or NONE


def _default(node: Mapping[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" not in node or node["default"] is None:
        return NONE
    value = node["default"]
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def model_rows(
    model: type[BaseModel], recurse: frozenset[str] = frozenset(), mode: str = "validation"
) -> Iterator[tuple[str, str, str, str]]:
    """``(path, type, default, validation)`` for every field of ``model``, in model order.

    Fields whose type is a model named in ``recurse`` get one row per sub-field instead.
    """
    schema = model.model_json_schema(by_alias=True, mode=mode)  # type: ignore[arg-type]
    defs = schema.get("$defs", {})

    def walk(node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, str, str, str]]:
        required = set(node.get("required", []))
        for key, raw in node["properties"].items():
            prop, name = _resolve(raw, defs)
            path = f"{prefix}{key}"
            if name in recurse:
                yield from walk(prop, f"{path}.")
                continue
            yield path, _type(prop, name), _default(prop, key in required), _validation(prop, name)

    yield from walk(schema, "")


def field_descriptions(
    model: type[BaseModel], recurse: frozenset[str] = frozenset(), mode: str = "validation"
) -> dict[str, str]:
    """``path -> description`` (the attribute docstring, one line) for every row of ``model``."""
    schema = model.model_json_schema(by_alias=True, mode=mode)  # type: ignore[arg-type]
    defs = schema.get("$defs", {})
    out: dict[str, str] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, raw in node["properties"].items():
            prop, name = _resolve(raw, defs)
            path = f"{prefix}{key}"
            if name in recurse:
                walk(prop, f"{path}.")
                continue
            text = raw.get("description") or prop.get("description")
            if text:
                out[path] = one_line(str(text))

    walk(schema, "")
    return out


def spec_rows() -> Iterator[tuple[str, str, str, str]]:
    """Rows of the spec table (the nested strategy, source, drain and agent fields flattened)."""
    return model_rows(api.WeightUpdateSpec, _RECURSE)


def status_rows() -> Iterator[tuple[str, str]]:
    """``(field, type)`` for every top-level status field, in model order."""
    schema = api.WeightUpdateStatus.model_json_schema(by_alias=True, mode="serialization")
    defs = schema.get("$defs", {})
    for key, raw in schema["properties"].items():
        prop, name = _resolve(raw, defs)
        type_text = "object" if name == "ReplicaCounts" else _type(prop, name)
        if key in ("startTime", "completionTime", "lastProgressTime", "abortedAt", "retriedAt"):
            type_text = "RFC 3339 time"
        yield key, type_text


def spec_meanings() -> dict[str, str]:
    """The description of every spec row (the models' attribute docstrings)."""
    return field_descriptions(api.WeightUpdateSpec, _RECURSE)


def status_meanings() -> dict[str, str]:
    """The description of every top-level status field."""
    return field_descriptions(api.WeightUpdateStatus, mode="serialization")


def spec_table() -> str:
    meanings = spec_meanings()
    lines = ["| Field | Type | Default | Validation | Meaning |", "|---|---|---|---|---|"]
    for path, type_text, default, validation in spec_rows():
        meaning = meanings.get(path, UNDOCUMENTED)
        lines.append(f"| `{path}` | {type_text} | {default} | {validation} | {meaning} |")
    return "\n".join(lines)


def status_table() -> str:
    meanings = status_meanings()
    lines = ["| Field | Type | Meaning |", "|---|---|---|"]
    for key, type_text in status_rows():
        meaning = meanings.get(key, UNDOCUMENTED)
        lines.append(f"| `{key}` | {type_text} | {meaning} |")
    return "\n".join(lines)


#: Agent wire models documented in docs/api.md: name -> (model, nested models flattened).
WIRE_MODELS: dict[str, tuple[type[BaseModel], frozenset[str]]] = {
    "UpdateRequest": (
        protocol.UpdateRequest,
        frozenset({"SourceSpec", "DrainSpec", "PrefetchSpec"}),
    ),
    "UpdateStatus": (protocol.UpdateStatus, frozenset()),
    "AgentState": (protocol.AgentState, frozenset()),
    "ErrorBody": (protocol.ErrorBody, frozenset()),
}

#: Wire models the operator sends (the others are answers).
REQUESTS = {"UpdateRequest"}

WIRE_MEANINGS: dict[str, dict[str, str]] = {
    "UpdateRequest": {
        "id": (
            "Update id, chosen by the caller; the operator sends `<name>-<version>` (lower-cased, "
            "`-rollback` appended for a rollback). The agent is idempotent by id."
        ),
        "version": "Version the replica serves after the commit.",
        "source.uri": "Absolute path or `file://` URI; other schemes → 422.",
        "source.manifest": (
            "Manifest (`weightroll manifest`); checked before the drain. Required when the agent "
            "has `--manifest-public-key`: `<manifest>.sig` must then verify against that key, "
            "for this `version`, else the update fails `manifest_signature_invalid`."
        ),
        "source.manifestDigest": (
            "`sha256:<hex>` of the manifest file's bytes (needs `source.manifest`); any other "
            "manifest fails the update `manifest_digest_mismatch` before the drain."
        ),
        "mode": (
            "`full`: every shard; `partial`: only the modules named by `scope`; `sparse`: a "
            "patch file against `baseVersion`."
        ),
        "baseVersion": (
            "Required for `partial` and `sparse` (deltas): the version they were computed "
            "against; the agent and every rank refuse one on another base."
        ),
        "scope": "Required for `partial` (tensor names, or prefixes ending in `.`); else absent.",
        "drain.mode": "`wait` (then abort after the timeout) or `abort` at once.",
        "drain.timeoutSeconds": "Bound of the `wait` drain.",
        "prefetch.mode": (
            "`Host`: every rank reads and verifies the checkpoint into host memory while the "
            "replica serves, and the drain only applies it (phases `Prefetching`, "
            "`Prefetched`; a failure there leaves the replica serving, unpaused). `None`: read "
            "inside the drain. Not for `sparse`."
        ),
        "prefetch.maxBytes": (
            "Most bytes one rank may stage in host memory; above it, or above the host's "
            "available memory, the update fails `prefetch_memory` before any read."
        ),
        "prefetch.awaitSwap": (
            "`true` (needs `Host`): the update stops in `Prefetched`, the replica serving and "
            "Ready with the staging held, until `POST /v1/updates/{id}/swap`; then it drains "
            "and applies as without it. The operator sets it to claim the pod for the drain "
            "only once its prefetch verified. `false`: the drain follows at once."
        ),
        "prefetch.swapDeadlineSeconds": (
            "Bound of the wait in `Prefetched` for the swap: past it the staging is freed and "
            "the update ends `Failed` (`swap_deadline`), the replica serving its old weights, "
            "not held."
        ),
    },
    "UpdateStatus": {
        "id": "The update id.",
        "version": "Target version.",
        "mode": "As requested.",
        "phase": (
            "`Pending`, (`prefetch.mode: Host`: `Prefetching`, `Prefetched`), `Draining`, "
            "`Loading`, `Verifying`, then one of `Committed`, `Failed`, `Aborted`."
        ),
        "ranks": "Latest `RankReport` per rank (`engine_agent/protocol/`).",
        "verdict": (
            "Set once terminal: `committed` is true only when every rank agreed and generation "
            "was resumed; `reasons` says why not, as `<code>: <message>`."
        ),
        "timings": (
            "Seconds per step: `preflight`, `prefetch` (prefetched only), `drain`, `begin`, "
            "`load`, `finish`, `verify`, `resume`, `total`; `window` from the drain's start to "
            "the resume."
        ),
        "startedAt": "RFC 3339.",
        "finishedAt": "RFC 3339, once terminal.",
        "message": "One line for humans.",
    },
    "AgentState": {
        "version": (
            'Version the ranks serve now (`weightroll_state`; `""` when they cannot be asked or '
            "disagree), not the agent's record: after vLLM restarts underneath, its boot version."
        ),
        "engineState": (
            "Worst state over the ranks: `clean`, `open`, `dirty`, `poisoned` (also when vLLM "
            "cannot be reached: unknown counts as unsafe)."
        ),
        "ready": "Same verdict as `/readyz`.",
        "paused": "Generation is paused (an update runs, or the replica is held).",
        "activeUpdateId": "The update in progress; null when none runs.",
        "ranks": "`RankStatus` per rank.",
        "source": "Where the served weights came from (the rollback target).",
        "message": "Why the replica is not ready, or the last event.",
        "committedVersion": "The version the agent last committed (its record).",
        "committedUpdateId": (
            "The update that committed what the ranks serve now; null when they do not serve "
            "the agent's last commit (restarted, poisoned, updating) or booted on their weights. "
            "The operator restores traffic only when this is the id of its attempt."
        ),
    },
    "ErrorBody": {
        "code": ("`unauthorized`, `malformed_json`, `invalid_request`, `not_found` or `conflict`."),
        "message": "Every problem, in one line.",
        "field": "The offending field (first one for 422; `id` for 404/409).",
        "activeId": "On a 409 from `POST /v1/updates`: the id of the update that runs.",
    },
}


def wire_table(name: str) -> str:
    model, recurse = WIRE_MODELS[name]
    meanings = WIRE_MEANINGS[name]
    request = name in REQUESTS
    column = "Default" if request else "Present"
    lines = [f"| `{name}` field | Type | {column} | Meaning |", "|---|---|---|---|"]
    for path, type_text, default, validation in model_rows(model, recurse):
        meaning = meanings.get(path, "**undocumented**")
        if not request:
            default = "always" if default == "required" else "optional"
        if validation != NONE:
            meaning = f"{meaning} ({validation})"
        lines.append(f"| `{path}` | {type_text} | {default} | {meaning} |")
    return "\n".join(lines)


def view_rows() -> Iterator[tuple[str, str, str]]:
    """``(path, type, description)`` of every field of ``weightroll status -o json``.

    Read from the JSON Schema generated from ``status_document.StatusView``, the same schema a
    pipeline validates the command's output against.
    """
    from weightroll_operator.status_document import view_schema

    schema = view_schema()
    defs = schema.get("$defs", {})

    def kind(raw: Mapping[str, Any], node: Mapping[str, Any]) -> str:
        if "anyOf" in raw:  # an Optional: "string or null"
            return " or ".join(str(option.get("type")) for option in raw["anyOf"])
        if "const" in node:
            return f"`{node['const']}`"
        if "enum" in node:
            return " \\| ".join(f"`{v}`" for v in node["enum"])
        return str(node.get("type"))

    def walk(node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, str, str]]:
        for key, raw in node["properties"].items():
            prop, _ = _resolve(raw, defs)
            path = f"{prefix}{key}"
            text = raw.get("description") or prop.get("description") or UNDOCUMENTED
            yield path, kind(raw, prop), str(text)
            if prop.get("type") == "object" and "properties" in prop:
                yield from walk(prop, f"{path}.")
            items, _ = _resolve(prop.get("items") or {}, defs)
            if "properties" in items:
                yield from walk(items, f"{path}[].")

    yield from walk(schema, "")


def view_table() -> str:
    lines = ["| Field | Type | Meaning |", "|---|---|---|"]
    lines += [f"| `{path}` | {type_text} | {text} |" for path, type_text, text in view_rows()]
    return "\n".join(lines)


#: Generated blocks of docs/api.md: marker name -> renderer.
BLOCKS: dict[str, Callable[[], str]] = {
    "spec-fields": spec_table,
    "status-fields": status_table,
    "status-view": view_table,
    **{f"wire-{name}": functools.partial(wire_table, name) for name in WIRE_MODELS},
}


def _markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- BEGIN GENERATED {name}: python tests/docs/api_reference.py --write -->",
        f"<!-- END GENERATED {name} -->",
    )


def render(text: str) -> str:
    """Return ``text`` with every generated block replaced by what the models generate."""
    for name, build in BLOCKS.items():
        begin, end = _markers(name)
        head, found, rest = text.partition(begin)
        if not found:
            raise ValueError(f"docs/api.md has no {begin!r}")
        _, found, tail = rest.partition(end)
        if not found:
            raise ValueError(f"docs/api.md has no {end!r}")
        text = f"{head}{begin}\n{build()}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/api.md in place")
    args = parser.parse_args(argv)
    current = API_MD.read_text()
    wanted = render(current)
    if args.write:
        API_MD.write_text(wanted)
        return 0
    if wanted != current:
        print("docs/api.md is out of date: python tests/docs/api_reference.py --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
