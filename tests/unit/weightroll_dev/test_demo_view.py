"""The cluster demo's asker keeps an answer only with the version the pod served throughout."""

from __future__ import annotations

import time
from typing import Any

from weightroll_dev.demo_view import Asker, serving, state_key


def pod(ready: bool, version: str | None = None, state: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "labels": {} if version is None else {"weightroll.io/weight-version": version},
            "annotations": {} if state is None else {"weightroll.io/weight-state": state},
        },
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


class Fleet:
    """One pod whose object the test changes; the asker's view is refreshed by ``tick``."""

    def __init__(self) -> None:
        self.current = {"p": pod(True)}
        self.on_ask: Any = None

    def ask(self, name: str, timeout: float) -> str:
        if self.on_ask is not None:
            self.on_ask()
        return "text"

    def read(self) -> dict[str, dict[str, Any]]:
        return dict(self.current)


def _collect(asker: Asker, fleet: Fleet, seconds: float) -> list[tuple[str, str, str]]:
    got: list[tuple[str, str, str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not got:
        asker.observe(time.monotonic(), fleet.read())
        got += asker.take()
        time.sleep(0.05)
    return got


def test_serving_and_state_key_read_the_pod() -> None:
    assert serving(pod(True)) and not serving(pod(False)) and not serving({})
    assert state_key(pod(True, "v2", "x")) == ("v2", "x", True)
    assert state_key(pod(True)) != state_key(pod(False))


def test_an_answer_is_kept_with_the_version_served_throughout() -> None:
    fleet = Fleet()
    asker = Asker(["p"], fleet.ask, fleet.read, default_version="v1")
    try:
        assert _collect(asker, fleet, 10) == [("p", "v1", "text")]
    finally:
        asker.stop(timeout=2)


def test_an_answer_given_while_the_pod_moved_is_dropped() -> None:
    fleet = Fleet()
    fleet.on_ask = lambda: fleet.current.update(p=pod(True, "v2", "Verified"))
    asker = Asker(["p"], fleet.ask, fleet.read, default_version="v1")
    try:
        # every question sees the pod change underneath it: nothing may be kept as "v1"
        got = _collect(asker, fleet, 1.5)
        assert ("p", "v1", "text") not in got
        # once the pod stays put, its answers are kept with the new version
        fleet.on_ask = None
        assert ("p", "v2", "text") in got + _collect(asker, fleet, 10)
    finally:
        asker.stop(timeout=2)


def test_a_drained_pod_is_not_asked() -> None:
    fleet = Fleet()
    fleet.current = {"p": pod(False)}
    asked: list[str] = []
    asker = Asker(["p"], lambda n, t: asked.append(n) or "x", fleet.read, default_version="v1")
    try:
        assert _collect(asker, fleet, 1.0) == []
        assert asked == []
    finally:
        asker.stop(timeout=2)
