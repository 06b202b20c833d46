"""The cluster demo's terminal output and its prompt asker (``weightroll_dev demo``).

:class:`Console` prints step headers, event lines and the per-pod view (redrawn in place on a
TTY, one line per change otherwise, e.g. in CI). :class:`Asker` asks every serving pod the same
prompt on its own threads while the view polls, and keeps an answer only when the pod served one
known version for the whole question. :func:`serving` and :func:`state_key` read a pod object.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Sequence
from typing import Any

from weightroll_operator.domain.model import ANNOTATION_WEIGHT_STATE, LABEL_WEIGHT_VERSION

__all__ = ["Asker", "Console", "condition", "serving", "state_key"]


def condition(pod: dict[str, Any], ctype: str) -> str | None:
    """The status (``"True"``...) of the pod condition ``ctype``, or ``None`` when unset."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return str(cond.get("status"))
    return None


def serving(pod: dict[str, Any]) -> bool:
    """In traffic: Ready, i.e. containers ready and the operator's gate True."""
    return condition(pod, "Ready") == "True"


def state_key(pod: dict[str, Any]) -> tuple[Any, ...]:
    """What says which weights a pod serves: version label, weight-state, serving."""
    meta = pod.get("metadata", {})
    return (
        (meta.get("labels") or {}).get(LABEL_WEIGHT_VERSION),
        (meta.get("annotations") or {}).get(ANNOTATION_WEIGHT_STATE),
        serving(pod),
    )


class Console:
    """Step headers, event lines and the per-pod view (in place on a TTY, else line per change)."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.began = time.monotonic()
        self._drawn = 0
        self._last: dict[str, str] = {}

    def _t(self) -> str:
        return f"[{time.monotonic() - self.began:6.1f}s]"

    def step(self, text: str, detail: str = "") -> None:
        self._clear()
        bold, off = ("\033[1m", "\033[0m") if self.tty else ("", "")
        print(f"{bold}==> {text}{off}" + (f"  {detail}" if detail else ""), flush=True)

    def line(self, text: str) -> None:
        self._clear()
        print(f"{self._t()} {text}", flush=True)

    def _clear(self) -> None:
        if self.tty and self._drawn:
            sys.stdout.write(f"\033[{self._drawn}F\033[J")
            self._drawn = 0

    def view(self, rows: dict[str, str], header: str) -> None:
        """Show one line per pod: redrawn in place on a TTY, printed when it changes otherwise."""
        if self.tty:
            self._clear()
            lines = [f"{self._t()} {header}", *(f"    {p:<16} {r}" for p, r in rows.items())]
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()
            self._drawn = len(lines)
            return
        for pod, row in rows.items():
            if self._last.get(pod) != row:
                self._last[pod] = row
                print(f"{self._t()} {pod:<16} {row}", flush=True)

    def done_view(self) -> None:
        self._drawn = 0
        self._last.clear()


class Asker:
    """Asks every serving pod the prompt during the rollout: one thread per pod, apart from the
    view loop, so a slow answer never hides a stage and every pod is asked about once a second.

    An answer is kept only with the version the pod served while it answered: the pod's state
    (version label, weight-state, in traffic) read before the question must equal the state in
    the first view snapshot read after the answer arrived; otherwise the pod moved meanwhile
    and the answer proves nothing. Answers are handed to the view loop (:meth:`take`), the only
    thread that prints.
    """

    def __init__(
        self,
        pods: Sequence[str],
        ask: Callable[[str, float], str],
        read_pods: Callable[[], dict[str, dict[str, Any]]],
        *,
        default_version: str,
    ) -> None:
        self._ask = ask
        self._read_pods = read_pods
        self._default_version = default_version
        self._lock = threading.Lock()
        self._snapshot: tuple[float, dict[str, dict[str, Any]]] = (float("-inf"), {})
        self._answers: list[tuple[str, str, str]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._ask_loop, args=(name,), name=f"ask-{name}", daemon=True)
            for name in pods
        ]
        for thread in self._threads:
            thread.start()

    def observe(self, read_at: float, pods: dict[str, dict[str, Any]]) -> None:
        """A fresh view of the pods, whose reading started at monotonic time ``read_at``."""
        with self._lock:
            self._snapshot = (read_at, pods)

    def take(self) -> list[tuple[str, str, str]]:
        """The answers kept since the last call: ``(pod, version, text)``."""
        with self._lock:
            out, self._answers = self._answers, []
        return out

    def stop(self, timeout: float = 8) -> None:
        """Ask nothing new; keep publishing views until the questions in flight are judged."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            read_at = time.monotonic()
            self.observe(read_at, self._read_pods())
            time.sleep(0.2)

    def _latest(self) -> tuple[float, dict[str, dict[str, Any]]]:
        with self._lock:
            return self._snapshot

    def _ask_loop(self, name: str) -> None:
        while not self._stop.wait(1.0):  # about one question a second per pod: light on 2 cores
            pod = self._latest()[1].get(name)
            if pod is None or not serving(pod):
                continue
            label = (pod["metadata"].get("labels") or {}).get(
                LABEL_WEIGHT_VERSION
            ) or self._default_version
            try:
                text = self._ask(name, 5)
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                continue
            answered = time.monotonic()
            while self._latest()[0] <= answered:  # wait for a view read after the answer
                if time.monotonic() - answered > 10:
                    return
                time.sleep(0.05)
            after = self._latest()[1].get(name)
            if after is not None and state_key(after) == state_key(pod):
                with self._lock:
                    self._answers.append((name, label, text))
