"""Generate the WeightUpdate field tables of ``docs/api.md`` from the pydantic models.

Run ``python tests/docs/api_reference.py --write`` after changing
``operator/weightroll_operator/api/v1alpha1.py``; ``tests/docs/test_api_reference.py`` fails when
the tables in ``docs/api.md`` differ from what the models generate, or when a field has no
meaning written here (or a meaning names a field the models no longer have).

Type, default and the schema-level validation (bounds, patterns, enums, required) come from the
models' JSON schema, so they cannot drift. The *meaning* of each field is prose kept in
:data:`SPEC_MEANINGS` / :data:`STATUS_MEANINGS` below (the models document fields with ``#:``
comments, which pydantic does not expose); rules the schema cannot express (sparse needs
``baseVersion``, percentages bounded to 100 %) are stated there.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from weightroll_operator.api import v1alpha1 as api

from engine_agent import protocol
from engine_agent.protocol import VERSION_PATTERN

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"

#: Table cell for "no default" / "no extra validation".
NONE = "-"
#: Objects whose fields get rows of their own; any other object is one row.
_RECURSE = frozenset({"SourceSpec", "StrategySpec", "DrainSpec", "AgentSpec"})

SPEC_MEANINGS: dict[str, str] = {
    "selector": (
        "The vLLM pods (`matchLabels` and/or `matchExpressions`, Kubernetes semantics); must not "
        "be empty. Pods being deleted are left out."
    ),
    "version": (
        "The weight version to serve; also written to the pod label "
        "`weightroll.io/weight-version` when a pod is restored."
    ),
    "source.uri": (
        "Where the agents read the weights: an absolute path or `file://` URI inside the pod "
        "(other schemes are reported as `InvalidSpec`). A directory of safetensors files, or "
        "one patch file for `sparse`."
    ),
    "source.manifest": (
        "Checkpoint manifest (`weightroll manifest`), path or `file://` URI; every byte each rank "
        "reads is checked against it before it reaches a live tensor."
    ),
    "source.mode": "`sparse` = a patch against `source.baseVersion` (required then).",
    "source.baseVersion": (
        "The version a sparse patch was computed against; required with `sparse`, refused with "
        "`full`."
    ),
    "groupBy": (
        "Pods sharing this label's value (e.g. a LeaderWorkerSet group) form one *unit*: "
        "drained, updated, verified and restored together. Without it each pod is a unit."
    ),
    "strategy.maxUnavailable": (
        'Units unavailable at once: an integer ≥ 1 or `"N%"` with 0 < N ≤ 100 (rounded down, '
        "at least 1), **counting units already not ready**. Starting a unit that is already not "
        "ready is free."
    ),
    "strategy.canary": (
        "Units updated first; the rest waits until every canary unit has a verdict."
    ),
    "strategy.pauseAfterCanary": (
        "Hold after the canary (phase `Paused`, reason `CanaryComplete`); set it to `false` to "
        "promote."
    ),
    "strategy.drain.mode": (
        "How the agent pauses generation before the reload: `wait` lets running requests "
        "finish (up to the timeout, then aborts them), `abort` aborts them at once."
    ),
    "strategy.drain.timeoutSeconds": "How long the agent waits for in-flight requests.",
    "strategy.trafficLabel": (
        "Also removed from a pod while it is drained and restored afterwards, for routers that "
        "ignore Pod readiness. Keep it out of your workload's own selector."
    ),
    "strategy.updateTimeoutSeconds": (
        "Limit per unit from its drain to the agents' verdict; past it the update is aborted "
        "and the unit fails (it stays drained)."
    ),
    "strategy.progressDeadlineSeconds": (
        "No unit transition for this long while work is left → phase `Failed` (reason "
        "`ProgressDeadlineExceeded`). Not counted while paused."
    ),
    "strategy.onFailure": (
        "When more than `maxFailedReplicas` units have failed: `Halt` stops starting units "
        "(failed units stay drained); `Rollback` reloads every touched unit in place to the "
        "version and source it served before."
    ),
    "strategy.maxFailedReplicas": (
        "Failed units tolerated before `onFailure` applies. Failed units stay drained and count "
        "as unavailable."
    ),
    "paused": "Hold new units; units in flight finish (phase `Paused`, reason `PausedBySpec`).",
    "agent.port": (
        "Deprecated check: the operator only calls the container port named `weightroll` of a "
        "selected pod; when set, every selected pod's `weightroll` port must equal it "
        "(`InvalidSpec` otherwise)."
    ),
    "agent.tokenSecretRef": (
        "Secret (in the WeightUpdate's namespace) holding the agents' bearer token (first line "
        "sent; see the threat model for rotation); it must carry the label "
        '`weightroll.io/agent-token: "true"` (`InvalidSpec` otherwise). Without it no token is '
        "sent and agents answer 401."
    ),
}

STATUS_MEANINGS: dict[str, str] = {
    "phase": "Where the rollout stands (see below).",
    "observedGeneration": "`metadata.generation` of the spec this status is about.",
    "targetVersion": (
        "The `spec.version` the persisted fields belong to; a new `spec.version` resets them."
    ),
    "replicas": (
        "Pods by state: `total`, `updated` (serving the version), `verified` (updated and "
        "traffic restored), `draining` (in flight), `failed`, `stale` (not at the version and "
        "not being worked on: paused, halted, blocked, superseded, agent unreachable)."
    ),
    "stableVersion": (
        "What the fleet served before (when every touched pod served the same version); the "
        "version itself after success."
    ),
    "conditions": (
        "`Progressing`, `Verified`, `Degraded`, `Paused`, `Blocked`, `InvalidSpec`, each with a "
        "reason (see below)."
    ),
    "pods": (
        "Up to 50 pods (failed pods always listed, even past 50) with `name`, `state` "
        "(`Verified`, `Updating`, `Pending`, `Failed`, `RolledBack`, `Blocked`, `Superseded`, "
        "`Unknown`), the `version` of the pod's weight-state annotation, a `reason` and, with "
        "`groupBy`, the `unit`."
    ),
    "startTime": "When the first unit was claimed (RFC 3339).",
    "completionTime": (
        "When every selected pod first served the version; stays set (convergence of later pods "
        "does not clear it)."
    ),
    "lastProgressTime": "Last unit transition (for `progressDeadlineSeconds`).",
    "abortedAt": (
        "Persisted halt intent (failure budget or deadline). Clear it and `abortReason` with a "
        "status patch, or change `spec.version`, to retry."
    ),
    "abortReason": "`FailureBudgetExceeded` or `ProgressDeadlineExceeded`.",
    "message": "One line, e.g. `Progressing: 37/100 pods verified at v2; 10 updating`.",
}


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
        if key in ("startTime", "completionTime", "lastProgressTime", "abortedAt"):
            type_text = "RFC 3339 time"
        yield key, type_text


def spec_table() -> str:
    lines = ["| Field | Type | Default | Validation | Meaning |", "|---|---|---|---|---|"]
    for path, type_text, default, validation in spec_rows():
        meaning = SPEC_MEANINGS.get(path, "**undocumented**")
        lines.append(f"| `{path}` | {type_text} | {default} | {validation} | {meaning} |")
    return "\n".join(lines)


def status_table() -> str:
    lines = ["| Field | Type | Meaning |", "|---|---|---|"]
    for key, type_text in status_rows():
        meaning = STATUS_MEANINGS.get(key, "**undocumented**")
        lines.append(f"| `{key}` | {type_text} | {meaning} |")
    return "\n".join(lines)


#: Agent wire models documented in docs/api.md: name -> (model, nested models flattened).
WIRE_MODELS: dict[str, tuple[type[BaseModel], frozenset[str]]] = {
    "UpdateRequest": (protocol.UpdateRequest, frozenset({"SourceSpec", "DrainSpec"})),
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
        "source.manifest": "Manifest (`weightroll manifest`); checked before the drain.",
        "mode": (
            "`full`: every shard; `partial`: only the modules named by `scope`; `sparse`: a "
            "patch file against `baseVersion`."
        ),
        "baseVersion": "Required for `sparse`.",
        "scope": "Required for `partial` (tensor names, or prefixes ending in `.`); else absent.",
        "drain.mode": "`wait` (then abort after the timeout) or `abort` at once.",
        "drain.timeoutSeconds": "Bound of the `wait` drain.",
    },
    "UpdateStatus": {
        "id": "The update id.",
        "version": "Target version.",
        "mode": "As requested.",
        "phase": (
            "`Pending`, `Draining`, `Loading`, `Verifying`, then one of `Committed`, `Failed`, "
            "`Aborted`."
        ),
        "ranks": "Latest `RankReport` per rank (`engine_agent/protocol.py`).",
        "verdict": (
            "Set once terminal: `committed` is true only when every rank agreed and generation "
            "was resumed; `reasons` says why not, as `<code>: <message>`."
        ),
        "timings": (
            "Seconds per step: `preflight`, `drain`, `begin`, `load`, `finish`, `verify`, "
            "`resume`, `total`."
        ),
        "startedAt": "RFC 3339.",
        "finishedAt": "RFC 3339, once terminal.",
        "message": "One line for humans.",
    },
    "AgentState": {
        "version": "Version every rank serves (the one the agent committed or adopted).",
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


#: Generated blocks of docs/api.md: marker name -> renderer.
BLOCKS: dict[str, Callable[[], str]] = {
    "spec-fields": spec_table,
    "status-fields": status_table,
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
