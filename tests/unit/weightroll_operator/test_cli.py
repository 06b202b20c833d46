"""The ``weightroll`` command: ``--help`` of the command and of every subcommand is complete,
and usage errors are one line that names the fix.

``--help`` runs in a subprocess (the real console script path, argparse's exit included) for the
top level, and through ``main(argv)`` for the subcommands (each imports its module lazily; the
``demo`` help must not need vLLM).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from weightroll_operator import cli

#: Options each subcommand's --help must list (the documented surface, docs/ and the chart).
EXPECTED_OPTIONS = {
    "operator": [
        "--namespace",
        "--all-namespaces",
        "--kubeconfig",
        "--context",
        "--interval",
        "--metrics-port",
        "--health-port",
        "--peering",
        "--priority",
        "--verbose",
    ],
    "agent": [
        "--host",
        "--port",
        "--vllm-url",
        "--token-file",
        "--state-dir",
        "--initial-version",
        "--initial-source",
        "--begin-timeout",
        "--load-timeout",
        "--finish-timeout",
        "--control-timeout",
        "--abort-pause-timeout",
        "--watch-interval",
        "--log-level",
    ],
    "manifest": ["DIR", "--out", "--version", "--base-version"],
    "status": [
        "NAME",
        "--namespace",
        "--kubeconfig",
        "--context",
        "--events",
        "--watch",
        "--timeout",
        "--output",
        "json",
        "yaml",
    ],
    "pause": ["NAME", "--namespace", "--kubeconfig", "--context", "spec.paused"],
    "resume": ["NAME", "--namespace", "--kubeconfig", "--context", "spec.paused"],
    "promote": [
        "NAME",
        "--namespace",
        "--kubeconfig",
        "--context",
        "--force",
        "spec.strategy.pauseAfterCanary",
        "CanaryComplete",
    ],
    "demo": ["--scenario", "--workdir"],
    "dev": ["up", "down"],
}


def test_subcommands_are_the_documented_ones() -> None:
    assert list(cli.SUBCOMMANDS) == [
        "operator",
        "agent",
        "manifest",
        "status",
        "pause",
        "resume",
        "promote",
        "abort",
        "retry",
    ]
    # Checkout-only (devtools/): listed where devtools/ is found, as in this checkout.
    assert list(cli.DEV_COMMANDS) == ["demo", "dev"]
    assert cli.devtools_dir() is not None


def test_top_level_help_lists_every_subcommand() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightroll_operator.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for name, (_, help_text) in {**cli.SUBCOMMANDS, **cli.DEV_COMMANDS}.items():
        assert name in done.stdout
        assert help_text.split()[0] in done.stdout
    assert "weightroll COMMAND --help" in done.stdout


def test_no_arguments_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: weightroll" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(EXPECTED_OPTIONS))
def test_subcommand_help_is_complete(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: weightroll {command}")
    for option in EXPECTED_OPTIONS[command]:
        assert option in out, f"weightroll {command} --help does not mention {option}"
    if command != "operator":  # its description is main.py's reST docstring (reported)
        assert "``" not in out and ":func:" not in out


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("weightroll_operator.main", ()),
        ("engine_agent.sidecar.main", ()),
        ("engine_agent.manifest", ()),
        ("weightroll_operator.status_view", ()),
        *(("weightroll_operator.control", (verb,)) for verb in ("pause", "resume", "promote")),
    ],
)
def test_every_option_has_a_help_text(module: str, args: tuple[str, ...]) -> None:
    parser = importlib.import_module(module)._parser(*args)
    missing = [a.dest for a in parser._actions if not a.help]
    assert missing == [], f"{module}: options without help: {missing}"


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stauts"]) == 2
    err = capsys.readouterr().err.splitlines()
    choices = "operator, agent, manifest, status, pause, resume, promote, abort, retry, demo, dev"
    assert err[-1] == f"weightroll: unknown command 'stauts'; choose one of {choices}"


def test_manifest_bad_directory_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["manifest", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"weightroll manifest: checkpoint {str(tmp_path / 'absent')!r} does not exist; "
        "pass a directory of *.safetensors files (or one such file)\n"
    )
    assert cli.main(["manifest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no *.safetensors files in" in err


def test_agent_without_token_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WEIGHTROLL_AGENT_TOKEN_FILE", raising=False)
    assert cli.main(["agent"]) == 2
    assert capsys.readouterr().err == (
        "weightroll agent: --token-file (or WEIGHTROLL_AGENT_TOKEN_FILE) is required\n"
    )


def test_agent_refuses_a_remote_vllm_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    argv = ["agent", "--token-file", str(token), "--vllm-url", "http://10.0.0.5:8000"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightroll agent: ") and err.count("\n") == 1
    assert "loopback" in err


@pytest.mark.parametrize("verb", ["pause", "resume", "promote"])
def test_control_verbs_reach_their_module(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([verb, "llama-v2", "--kubeconfig", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weightroll {verb}: cannot load a kubeconfig")


def test_status_missing_kubeconfig_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "llama-v2", "--kubeconfig", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "set KUBECONFIG" in err


def test_operator_refuses_an_out_of_range_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WEIGHTROLL_BURST", "0")
    assert cli.main(["operator"]) == 2
    assert capsys.readouterr().err == (
        "weightroll operator: WEIGHTROLL_BURST='0': must be a whole number at least 1 "
        "(pods one pass starts a forward step on)\n"
    )
