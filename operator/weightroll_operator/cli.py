"""The ``weightroll`` command (also ``kubectl weightroll``): the user's verbs, nothing else.

``status``, ``pause``, ``resume``, ``promote``, ``abort``, ``retry`` (a WeightUpdate on the
cluster), ``manifest`` (a checkpoint's manifest), ``lint`` (manifests checked offline with the
admission validator), ``completion`` (a shell completion script) and ``--version``. Each
subcommand imports its implementation lazily; modules expose ``main(argv) -> int`` and own their
``--help``; the day-2 verbs share one module, whose ``main`` gets the verb first.

The same ``main`` is installed twice (``pyproject.toml``): as ``weightroll`` and as
``kubectl-weightroll``, which kubectl runs for ``kubectl weightroll ...`` (kubectl's plugin
mechanism: an executable named ``kubectl-<name>`` on ``PATH``).

The two daemons have their own commands, named as the containers run them:
``weightroll-operator`` (``weightroll_operator.main``) and ``weightroll-agent``
(``engine_agent.sidecar.main``). The demo and the dev cluster belong to a checkout:
``make demo`` / ``weightroll_dev demo|dev`` (``devtools/``, never packaged).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

#: ``weightroll pause|resume|promote|abort|retry``: one module; its ``main`` gets the verb first.
CONTROL = "weightroll_operator.control"
#: subcommand -> (module exposing ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "status": (
        "weightroll_operator.status_view",
        "show a WeightUpdate NAME (phase, pods, conditions, events; -o json|yaml); exit 0 "
        "Succeeded, 3 Failed, 4 not finished; --watch waits for the end",
    ),
    "pause": (
        CONTROL,
        "pause a WeightUpdate NAME: units in flight finish, no new unit starts (spec.paused)",
    ),
    "resume": (
        CONTROL,
        "resume a paused WeightUpdate NAME: new units start again",
    ),
    "promote": (
        CONTROL,
        "promote a WeightUpdate NAME held after its canary (spec.strategy.pauseAfterCanary)",
    ),
    "abort": (
        CONTROL,
        "halt a WeightUpdate NAME: nothing new starts; onFailure Rollback rolls back",
    ),
    "retry": (
        CONTROL,
        "resume a WeightUpdate NAME after any halt: failed pods are tried again",
    ),
    "manifest": (
        "engine_agent.manifest.cli",
        "write a JSON manifest (BLAKE3 per tensor) for a checkpoint",
    ),
    "lint": (
        "weightroll_operator.lint",
        "check WeightUpdate manifests FILE... offline, with the admission webhook's validator",
    ),
    "completion": (
        "weightroll_operator.cli",
        "print a completion script: source <(weightroll completion bash) (or zsh)",
    ),
}
#: What the commands that left this CLI became: said instead of "unknown command".
MOVED: dict[str, str] = {
    "operator": "the operator is its own command now: weightroll-operator",
    "agent": "the pod sidecar is its own command now: weightroll-agent",
    "demo": "a development command of the repository checkout: run `make demo` (or "
    "`python -m weightroll_dev demo`) in a clone",
    "dev": "a development command of the repository checkout: run "
    "`python -m weightroll_dev dev up|down` in a clone",
}


def version() -> str:
    """The installed distribution's version (a checkout's editable install has one too)."""
    try:
        return importlib.metadata.version("weightroll")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


#: The console script kubectl runs as its ``weightroll`` plugin.
KUBECTL_PLUGIN = "kubectl-weightroll"


def _prog() -> str:
    """``kubectl weightroll`` when run as the kubectl plugin, else ``weightroll``."""
    return "kubectl weightroll" if Path(sys.argv[0]).name == KUBECTL_PLUGIN else "weightroll"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="Roll verified in-place weight updates through vLLM servers.",
        epilog="Run `weightroll COMMAND --help` for the options of one command. "
        "Docs: README.md, docs/getting-started.md, docs/api.md.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


#: Options every verb that names a WeightUpdate takes (kubectl's spelling).
_KUBE_OPTIONS = ("--namespace", "-n", "--kubeconfig", "--context", "--help")
_BASH = """# weightroll completion for bash: source <(weightroll completion bash)
_weightroll() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}} verb=${{COMP_WORDS[1]}}
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W {verbs} -- "$cur")); return
  fi
  case "$verb" in
    {named})
      if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W {options} -- "$cur")); else
        COMPREPLY=($(compgen -W "$(kubectl get weightupdates -o name 2>/dev/null \\
          | sed 's|.*/||')" -- "$cur")); fi ;;
    lint|manifest) COMPREPLY=($(compgen -f -- "$cur")) ;;
    completion) COMPREPLY=($(compgen -W "bash zsh" -- "$cur")) ;;
  esac
}}
complete -F _weightroll weightroll kubectl-weightroll
"""


def completion_script(shell: str) -> str:
    """The completion script for ``shell`` (``bash``; ``zsh`` runs it through bashcompinit):
    verbs, the kubectl options, WeightUpdate names from ``kubectl get`` and files for ``lint``
    and ``manifest``."""
    named = [
        n for n, (module, _) in SUBCOMMANDS.items() if module in (CONTROL, SUBCOMMANDS["status"][0])
    ]
    script = _BASH.format(
        verbs=shlex.quote(" ".join([*SUBCOMMANDS, "--version", "--help"])),
        named="|".join(named),
        options=shlex.quote(" ".join(_KUBE_OPTIONS)),
    )
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + script
    return script


def _completion(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{_prog()} completion",
        description="Print a shell completion script for weightroll and kubectl-weightroll: "
        "source <(weightroll completion bash), or add that line to ~/.bashrc (zsh: the same "
        "with zsh, in ~/.zshrc).",
    )
    parser.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete in")
    args = parser.parse_args(list(argv))
    sys.stdout.write(completion_script(args.shell))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0] in ("-h", "--help", "--version"):
        if args:
            parser.parse_args(args[:1])  # prints and exits 0
        parser.print_help()
        return 2
    command, rest = args[0], args[1:]
    if command in MOVED:
        print(f"{_prog()} {command}: {MOVED[command]}", file=sys.stderr)
        return 2
    if command not in SUBCOMMANDS:
        parser.print_usage(sys.stderr)
        print(
            f"{_prog()}: unknown command {command!r}; choose one of {', '.join(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    if command == "completion":
        return _completion(rest)
    target = SUBCOMMANDS[command][0]
    if target == CONTROL:
        rest = [command, *rest]
    module = importlib.import_module(target)
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
