"""A real Prometheus server for the e2e tier: scrapes given targets, evaluates given rules.

Debian's ``prometheus`` package (``scripts/system-deps.sh``) provides the binary. The server
listens on loopback only, keeps its TSDB in a temporary directory, scrapes and evaluates every
``interval`` (bounded: at least 1 s, the scrape timeout equal to it) and is stopped with SIGTERM
(SIGKILL only if it does not exit). :class:`Target` labels mirror what the chart's
ServiceMonitor (operator) and a PodMonitor (agents) give a target: ``job``, ``namespace``,
``pod``.

Limitations: static targets only (no Kubernetes service discovery: the test apiserver has no
endpoints controller, and the simulated pods' IPs exist only on this machine).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.harness.polling import poll
from tests.harness.ports import free_port

__all__ = ["Prometheus", "PrometheusError", "Target", "prometheus_binary"]

T = TypeVar("T")


class PrometheusError(RuntimeError):
    """The server answered a query or API call with an error (e.g. a PromQL parse error)."""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@dataclass(frozen=True)
class Target:
    """One scrape target: ``host:port`` and the labels its scrape job gives it."""

    job: str
    address: str
    labels: Mapping[str, str] = field(default_factory=dict)
    path: str = "/metrics"
    #: Keep the scraped labels on a clash with target labels (``honorLabels``).
    honor_labels: bool = False


@dataclass
class Prometheus:
    """One Prometheus process; use as a context manager (``with Prometheus(...) as prom``).

    Args:
        workdir: holds the config, the rule file and the TSDB.
        targets: what to scrape.
        rule_groups: Prometheus rule groups (a rule file's ``groups``), or none.
        interval: seconds between scrapes and between rule evaluations.
    """

    workdir: Path
    targets: Sequence[Target]
    rule_groups: Sequence[Mapping[str, Any]] = ()
    interval: float = 1.0
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "prometheus.log"

    def _config(self) -> dict[str, Any]:
        every = f"{max(self.interval, 1.0):g}s"
        jobs: dict[tuple[str, str, bool], list[Target]] = {}
        for target in self.targets:
            jobs.setdefault((target.job, target.path, target.honor_labels), []).append(target)
        return {
            "global": {
                "scrape_interval": every,
                "scrape_timeout": every,
                "evaluation_interval": every,
            },
            "rule_files": ["rules.yaml"] if self.rule_groups else [],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": path,
                    "honor_labels": honor,
                    "static_configs": [
                        {"targets": [t.address], "labels": dict(t.labels)} for t in targets
                    ],
                }
                for (job, path, honor), targets in jobs.items()
            ],
        }

    def start(self, timeout: float = 60) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (scripts/system-deps.sh)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.rule_groups:
            rules = {"groups": [dict(g) for g in self.rule_groups]}
            (self.workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(self._config()))
        self.port = self.port or free_port()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    "--storage.tsdb.retention.time=2h",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.process.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout}s: {self.tail()}")
            time.sleep(0.5)

    def stop(self, timeout: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------------------ the API

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) of ``expr`` now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, str]]:
        """Labels of the active alerts named ``name`` in ``state`` (``firing``/``pending``)."""
        return [
            dict(a["labels"])
            for a in self.api("alerts")["alerts"]
            if a["labels"].get("alertname") == name and a["state"] == state
        ]

    def targets_up(self) -> dict[str, str]:
        """``scrapeUrl -> health`` of every active target."""
        return {t["scrapeUrl"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def rule_health(self) -> dict[str, str]:
        """``rule name -> health`` (``ok``/``err``/``unknown``) of every loaded rule."""
        return {
            r["name"]: f"{r['health']} {r.get('lastError', '')}".strip()
            for g in self.api("rules")["groups"]
            for r in g["rules"]
        }

    def wait(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        """Poll ``check`` (every interval) until it returns something truthy."""
        return poll(what, check, timeout, self.interval, context=self.tail)
