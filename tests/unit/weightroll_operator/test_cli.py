"""The ``weightroll`` command (the user's verbs) and the two daemons' commands
(``weightroll-operator``, ``weightroll-agent``): ``--help`` of each is complete, and usage errors
are one line that names the fix.

``--help`` runs in a subprocess (the real console script path, argparse's exit included) for the
top level, and through ``main(argv)`` for the subcommands (each imports its module lazily).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from weightroll_operator import cli
from weightroll_operator.main import kopf_options
from weightroll_operator.main import main as operator_main

from engine_agent.sidecar.main import main as agent_main

#: Options each subcommand's --help must list (the documented surface, docs/ and the chart).
DAEMON_OPTIONS = {
    "weightroll_operator.main": [
        "--namespace",
        "--all-namespaces",
        "--kubeconfig",
        "--context",
        "--interval",
        "--metrics-port",
        "--health-port",
        "--leader-elect",
        "--verbose",
    ],
    "engine_agent.sidecar.main": [
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
}
#: Options each verb's --help must list (the documented surface, docs/ and the chart).
EXPECTED_OPTIONS = {
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
    "lint": ["FILE"],
    "completion": ["bash", "zsh"],
}


def test_subcommands_are_the_users_verbs_only() -> None:
    """Issue 31 item 2: the daemons have their own commands; demo and dev stay in a checkout."""
    assert list(cli.SUBCOMMANDS) == [
        "status",
        "pause",
        "resume",
        "promote",
        "abort",
        "retry",
        "manifest",
        "lint",
        "completion",
    ]


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ("operator", "weightroll-operator"),
        ("agent", "weightroll-agent"),
        ("demo", "make demo"),
        ("dev", "python -m weightroll_dev dev up|down"),
    ],
)
def test_a_command_that_moved_says_where(
    command: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weightroll {command}: ") and err.count("\n") == 1
    assert said in err


def test_version_is_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"weightroll {importlib.metadata.version('weightroll')}\n"


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_is_valid_and_lists_every_verb(
    shell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["completion", shell]) == 0
    script = capsys.readouterr().out
    checked = subprocess.run(
        ["bash", "-n"], input=script, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stderr
    for verb in cli.SUBCOMMANDS:
        assert verb in script
    assert "kubectl get weightupdates -o name" in script
    assert "complete -F _weightroll weightroll kubectl-weightroll" in script


def test_completion_completes_verbs_and_files_in_bash(tmp_path: Path) -> None:
    """The script run by bash itself: a verb prefix completes to the verb."""
    (tmp_path / "wu.yaml").write_text("")
    probe = (
        f"{cli.completion_script('bash')}\n"
        'COMP_WORDS=(weightroll pa); COMP_CWORD=1; _weightroll; echo "${COMPREPLY[@]}"\n'
        'COMP_WORDS=(weightroll lint wu); COMP_CWORD=2; _weightroll; echo "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["pause", "wu.yaml"]


def test_top_level_help_lists_every_subcommand() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weightroll_operator.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for name, (_, help_text) in cli.SUBCOMMANDS.items():
        assert name in done.stdout
        assert help_text.split()[0] in done.stdout
    assert "weightroll COMMAND --help" in done.stdout
    for gone in cli.MOVED:
        assert f"\n    {gone} " not in done.stdout


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
    assert "``" not in out and ":func:" not in out


@pytest.mark.parametrize("module", sorted(DAEMON_OPTIONS))
def test_daemon_help_is_complete(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(module)
    with pytest.raises(SystemExit) as done:
        main.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {main._parser().prog}")
    for option in DAEMON_OPTIONS[module]:
        assert option in out, f"{module} --help does not mention {option}"


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("weightroll_operator.main", ()),
        ("engine_agent.sidecar.main", ()),
        ("engine_agent.manifest.cli", ()),
        ("weightroll_operator.lint", ()),
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
    choices = "status, pause, resume, promote, abort, retry, manifest, lint, completion"
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
    assert agent_main([]) == 2
    assert capsys.readouterr().err == (
        "weightroll-agent: --token-file (or WEIGHTROLL_AGENT_TOKEN_FILE) is required\n"
    )


def test_agent_refuses_a_remote_vllm_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    argv = ["--token-file", str(token), "--vllm-url", "http://10.0.0.5:8000"]
    assert agent_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightroll-agent: ") and err.count("\n") == 1
    assert "loopback" in err


@pytest.mark.parametrize("verb", ["pause", "resume", "promote"])
def test_control_verbs_reach_their_module(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([verb, "llama-v2", "--kubeconfig", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err == f"weightroll {verb}: stat {tmp_path / 'nope'}: no such file or directory\n"


def test_status_missing_kubeconfig_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "llama-v2", "--kubeconfig", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err == f"weightroll status: stat {tmp_path / 'nope'}: no such file or directory\n"


def test_operator_refuses_an_out_of_range_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WEIGHTROLL_BURST", "0")
    assert operator_main([]) == 2
    assert capsys.readouterr().err == (
        "weightroll-operator: WEIGHTROLL_BURST='0': must be a whole number at least 1 "
        "(pods one pass starts a forward step on)\n"
    )


@pytest.mark.parametrize("flag", ["--peering=weightroll", "--priority=1", "--standalone"])
def test_operator_has_no_kopf_peering_flags(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One HA mechanism: the leader Lease (--leader-elect); kopf's peering is not offered."""
    with pytest.raises(SystemExit) as done:
        operator_main([flag])
    assert done.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("namespaces", "all_namespaces", "clusterwide"),
    [([], False, True), ([], True, True), (["ml", "ml-*"], False, False)],
    ids=["default", "all-namespaces", "named"],
)
def test_kopf_runs_standalone_in_every_scope(
    namespaces: list[str], all_namespaces: bool, clusterwide: bool
) -> None:
    """kopf never looks for KopfPeering objects (the chart grants none), whatever the scope."""
    assert kopf_options(namespaces, all_namespaces) == {
        "standalone": True,
        "namespaces": namespaces,
        "clusterwide": clusterwide,
    }
