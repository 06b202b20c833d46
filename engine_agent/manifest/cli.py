"""``weightroll manifest``: write a checkpoint's manifest and print its pin.

The operator's ``weightroll`` CLI imports this module by name (one lazy import per subcommand)
and calls :func:`main`; exit status 0 written, 1 the checkpoint cannot be hashed or the manifest
not written, 2 bad usage. ``python -m engine_agent.manifest`` runs it too (the package's
``__main__``; this module has no ``__main__`` guard, since the package imports it first).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from engine_agent.manifest.build import build_manifest
from engine_agent.manifest.file import manifest_bytes, manifest_file_digest, write_manifest
from engine_agent.manifest.format import ManifestError

__all__ = ["DEFAULT_MANIFEST_NAME", "main"]

#: File name ``weightroll manifest DIR`` writes inside DIR when ``--out`` is not given.
DEFAULT_MANIFEST_NAME: Final = "weightroll-manifest.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightroll manifest",
        description=(
            "Write a JSON manifest (dtype, shape, content hash per tensor, total bytes, digest) "
            "for a safetensors checkpoint."
        ),
        epilog=(
            "Only *.safetensors files directly inside DIR are hashed (with "
            "model.safetensors.index.json: exactly the files it lists). Name the manifest in the "
            "WeightUpdate's spec.source.manifest; every rank checks the bytes it reads against "
            "it before writing a live tensor. Prints the manifest file's pin (sha256:<hex> of "
            "its exact bytes) on stdout (on stderr with --out -): put it in "
            "spec.source.manifestDigest and the agents refuse any other manifest before "
            "draining. Exit status: 0 written, 1 the checkpoint cannot be hashed or the "
            "manifest not written, 2 bad usage."
        ),
    )
    parser.add_argument("directory", metavar="DIR", help="checkpoint directory (or one file)")
    parser.add_argument(
        "--out",
        metavar="FILE",
        help=f"where to write the manifest ('-' for stdout; default DIR/{DEFAULT_MANIFEST_NAME})",
    )
    parser.add_argument("--version", metavar="V", help="weight version of this checkpoint")
    parser.add_argument(
        "--base-version", metavar="V", help="for delta/sparse checkpoints: the base version"
    )
    parser.add_argument(
        "--hash",
        choices=("blake3", "sha256"),
        default="blake3",
        help="content hash: blake3 (format v2, default) or sha256 (format v1)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``weightroll manifest DIR [--out FILE] [--version V] [--base-version V] [--hash H]``.

    Returns:
        0 on success, 1 when the checkpoint cannot be hashed, 2 on bad usage.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        manifest = build_manifest(
            args.directory, args.version, args.base_version, algorithm=args.hash
        )
    except ManifestError as e:
        root = Path(args.directory)
        bad_dir = not root.exists() or (root.is_dir() and not any(root.glob("*.safetensors")))
        hint = "; pass a directory of *.safetensors files (or one such file)" if bad_dir else ""
        print(f"weightroll manifest: {e}{hint}", file=sys.stderr)
        return 1
    if args.out == "-":
        # stdout is the manifest itself; the pin of exactly these bytes goes to stderr
        raw = manifest_bytes(manifest)
        sys.stdout.write(raw.decode("ascii"))  # json.dumps escapes to ASCII: same bytes
        sys.stdout.flush()
        print(f"manifestDigest: {manifest_file_digest(raw)}", file=sys.stderr)
        return 0
    root = Path(args.directory)
    out = Path(args.out) if args.out else (root if root.is_dir() else root.parent)
    if not args.out:
        out = out / DEFAULT_MANIFEST_NAME
    try:
        pin = write_manifest(manifest, out)
    except OSError as e:
        print(f"weightroll manifest: cannot write {str(out)!r}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(
        f"Wrote manifest for {len(manifest.tensors)} tensors ({manifest.total_bytes} bytes) to "
        f"{out}; pin it with spec.source.manifestDigest: {pin}",
        file=sys.stderr,
    )
    print(pin)  # stdout: just the pin, for DIGEST=$(weightroll manifest DIR)
    return 0
