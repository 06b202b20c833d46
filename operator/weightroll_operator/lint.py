"""``weightroll lint FILE...``: check WeightUpdate manifests offline, with admission's validator.

Each YAML document that is a ``weightroll.io`` ``WeightUpdate`` goes through
:func:`weightroll_operator.webhook.validate` — the function the operator's admission webhook
answers with — as a CREATE, plus the object-name rule of the API server, so a file that lints
clean is refused by neither for its spec (the server may still refuse an UPDATE that changes
``spec.source`` under the same ``spec.version``: that rule needs the stored object). Other
documents (a Secret beside the WeightUpdate, a Deployment) are skipped and said so. No cluster,
no kubeconfig.

Prints one line per WeightUpdate (``FILE: NAME: ok`` or the problem, naming the field) and
exits 0 when every one is valid, 1 when any is not, 2 when a file cannot be read or parsed.
``-`` reads standard input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from weightroll_operator.api.names import is_dns_subdomain
from weightroll_operator.webhook import validate

__all__ = ["lint_text", "main"]

GROUP = "weightroll.io"
KIND = "WeightUpdate"
VERSIONS = ("v1alpha1",)


def _documents(text: str) -> Iterator[Any]:
    yield from yaml.safe_load_all(text)


def lint_text(text: str) -> list[tuple[str, str | None]]:
    """``(what, problem)`` for each document of ``text``: ``problem`` is ``None`` for a valid
    WeightUpdate, ``"skipped: ..."`` for a document that is not one.

    Raises:
        yaml.YAMLError: the text is not YAML.
    """
    found: list[tuple[str, str | None]] = []
    for index, doc in enumerate(_documents(text)):
        if doc is None:
            continue
        if not isinstance(doc, Mapping):
            found.append((f"document {index + 1}", "not a Kubernetes object (not a mapping)"))
            continue
        given_meta = doc.get("metadata")
        meta: Mapping[str, Any] = given_meta if isinstance(given_meta, Mapping) else {}
        name = str(meta.get("name") or f"document {index + 1}")
        group, _, version = str(doc.get("apiVersion") or "").rpartition("/")
        if doc.get("kind") != KIND or group != GROUP:
            found.append((name, f"skipped: {doc.get('kind')} {doc.get('apiVersion')}"))
            continue
        if version not in VERSIONS:
            found.append(
                (name, f"apiVersion: {GROUP}/{version} is not served; use {GROUP}/v1alpha1")
            )
            continue
        problem = validate(doc, None)
        given = meta.get("name")
        if not (is_dns_subdomain(str(given)) if given else meta.get("generateName")):
            problem = (
                "metadata.name: must be a lowercase DNS subdomain (a-z, 0-9, '-', '.'; at "
                "most 253 characters), e.g. llama-v2"
            )
        found.append((name, problem))
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightroll lint",
        description="Check WeightUpdate manifests without a cluster, with the validator the "
        "admission webhook uses: every problem names its field and the fix. Exit status: 0 "
        "valid, 1 a WeightUpdate is invalid, 2 a file cannot be read or is not YAML.",
    )
    parser.add_argument(
        "files", nargs="+", metavar="FILE", help="YAML files (several documents each); - for stdin"
    )
    return parser


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    worst = 0
    for path in args.files:
        try:
            results = lint_text(_read(path))
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            print(f"weightroll lint: {path}: cannot read it ({reason})", file=sys.stderr)
            worst = 2
            continue
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            print(f"weightroll lint: {path}: not YAML{where}", file=sys.stderr)
            worst = 2
            continue
        if not any(problem is None or not problem.startswith("skipped") for _, problem in results):
            print(f"{path}: no WeightUpdate in it")
        for what, problem in results:
            print(f"{path}: {what}: {problem or 'ok'}")
            if problem is not None and not problem.startswith("skipped"):
                worst = max(worst, 1)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
