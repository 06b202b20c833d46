"""Dev clusters shared by the test modules that need an identical one (issue 27 C).

A ``weightroll_dev dev up`` costs minutes of both cores (the API server, the chart, three vLLM
servers and a reference one); the modules on the ``fleet`` (and on the ``injected``) cluster
each brought up their own, identical one. Here one cluster of each kind serves every module
that asks for it, in turn:

* the first module brings it up; each later module gets it back in the state ``dev up`` left
  (:func:`reset_to_boot`): no WeightUpdate, every node-local checkpoint copy equal to the shared
  one, every pod Ready and serving the boot version, no drained series exported. A module
  judges only what it did itself (Events it did not see before, metrics of its own
  WeightUpdates), so it passes alone and after any other module;
* a cluster that cannot be given back in that state (its operator stopped, the reference pod a
  module needs deleted) is torn down and the next module brings up a fresh one;
* the cluster goes down (``dev down``, nothing left running) after the last module of the run
  that uses it, not at the end of the session: later tiers get its cores and memory back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from weightroll_dev.devcluster.bringup import BOOT, MANIFEST

from tests.e2e import conftest as e2e
from tests.harness.polling import poll

__all__ = ["ENDS_CLUSTER", "NEEDS_REFERENCE", "POOL", "SharedFleets", "repair_copy"]

#: Marks a module that leaves its shared cluster unusable (it stops the operator): it runs after
#: every other module on that cluster (``pytest_collection_modifyitems`` in the conftest).
ENDS_CLUSTER = "ends_shared_cluster"
#: Marks a module that needs the reference pod (``vllm-cold``) of the ``fleet`` cluster.
NEEDS_REFERENCE = "needs_reference_pod"
#: The WeightUpdate that rolls a used cluster back to the boot version (deleted after).
RESET = "reset-to-boot"
#: Seconds for the reset's rollout (three reloads on a loaded 2-core machine, with room).
RESET_TIMEOUT = 600


@dataclass
class _Shared:
    directory: Path
    fleet: e2e.Fleet


def repair_copy(fleet: e2e.Fleet, pod: str, version: str) -> list[str]:
    """Give ``pod`` back the shared copy of ``version``: remove its own (corrupt) files, which
    the dev cluster's volume sync links back in from the persistent volume within a second.

    Returns the names of the files repaired (none: the copy was intact)."""
    shared = Path(fleet.info.persistentVolume) / version
    mine = Path(fleet.info.podVolumes[pod]) / version
    differs = [
        f
        for f in sorted(shared.glob("*.safetensors"))
        if (mine / f.name).exists() and not (mine / f.name).samefile(f)
    ]
    for f in differs:
        (mine / f.name).unlink()
    poll(
        f"{pod}'s copy of {version} linked back to the shared one",
        lambda: all((mine / f.name).exists() and (mine / f.name).samefile(f) for f in differs),
        timeout=30,
    )
    return [f.name for f in differs]


def _drained_series(fleet: e2e.Fleet) -> list[dict[str, str]]:
    return [
        labels
        for name, labels, _ in fleet.metrics()
        if name == "weightroll_replica_drained_since_timestamp_seconds"
    ]


def _has_reference(fleet: e2e.Fleet) -> bool:
    if e2e.COLD not in fleet.info.references:
        return False
    found = fleet.kubectl(
        "get", "pod", e2e.COLD, "-n", e2e.NAMESPACE, "--ignore-not-found", "-o", "name"
    )
    return bool(found.strip())


def _at_boot(fleet: e2e.Fleet) -> bool:
    for pod in fleet.pods:
        state = fleet.agent_state(pod)
        if state.get("version") != BOOT or not state.get("ready"):
            return False
        if fleet.condition(pod, e2e.GATE) != "True" or fleet.condition(pod, "Ready") != "True":
            return False
    return True


def reset_to_boot(fleet: e2e.Fleet) -> None:
    """Bring a used cluster back to what ``dev up`` left it (see the module doc).

    Raises:
        AssertionError: the cluster could not be brought back (the next module must not run
            on a state it does not expect).
    """
    began = time.monotonic()
    pv = Path(fleet.info.persistentVolume)
    versions = sorted(p.name for p in pv.iterdir() if (p / MANIFEST).is_file())
    for pod in fleet.pods:
        for version in versions:
            repair_copy(fleet, pod, version)
    # the finalizer releases every pod a WeightUpdate owns before the object goes
    fleet.kubectl(
        "delete", "weightupdates.weightroll.io", "--all", "-n", e2e.NAMESPACE, "--timeout=180s"
    )
    if not _at_boot(fleet):
        fleet.apply_weightupdate(RESET, BOOT)
        status = fleet.wait_phase(RESET, "Succeeded", "Failed", timeout=RESET_TIMEOUT)
        assert status["phase"] == "Succeeded", f"the reset to {BOOT} failed: {status}"
        fleet.wait_pods("Ready", "True", fleet.pods, timeout=120)
        fleet.kubectl(
            "delete", "weightupdates.weightroll.io", RESET, "-n", e2e.NAMESPACE, "--timeout=180s"
        )
        assert _at_boot(fleet), {pod: fleet.agent_state(pod) for pod in fleet.pods}
    poll(
        "no drained series exported after the reset",
        lambda: not _drained_series(fleet),
        timeout=60,
        context=lambda: f"{_drained_series(fleet)}\n{fleet.logs()}",
    )
    fleet.timings["reset_s"] = time.monotonic() - began


class SharedFleets:
    """One running dev cluster per kind (``fleet``, ``injected``); see the module doc."""

    def __init__(self) -> None:
        self._up: dict[str, _Shared] = {}
        #: Bring-ups per kind in this run (logged: the figure issue 27 C counts).
        self._bring_ups: dict[str, int] = {}

    def acquire(
        self,
        kind: str,
        request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory,
        dev_up_args: tuple[str, ...],
        pods: tuple[str, ...],
    ) -> e2e.Fleet:
        """The ``kind`` cluster for the module of ``request``: reused (reset) or brought up."""
        needs_reference = request.node.get_closest_marker(NEEDS_REFERENCE) is not None
        shared = self._up.get(kind)
        if shared is not None:
            usable = shared.fleet.info.operator_alive()
            if needs_reference:
                usable = usable and _has_reference(shared.fleet)
            if usable:
                try:
                    reset_to_boot(shared.fleet)
                except BaseException:
                    self.close(kind)  # the next module gets a fresh cluster, this one fails
                    raise
                return shared.fleet
            self.close(kind)
        e2e.skip_without_dev_cluster()
        directory = tmp_path_factory.mktemp(kind) / "dev"
        began = time.monotonic()
        info, _ = e2e.dev_up(directory, *dev_up_args)
        self._bring_ups[kind] = self._bring_ups.get(kind, 0) + 1
        fl = e2e.Fleet(info=info, pods=pods)
        self._up[kind] = _Shared(directory, fl)
        request.config.add_cleanup(lambda: self.close(kind))
        try:
            if info.references:
                # The reference pod boots (≈1-2 min of both cores) while `dev up` already
                # returned: the tests start once it serves, not beside its boot (a 12-token
                # completion of a pod then took over a minute on a loaded 2-core machine).
                fl.wait_serving(e2e.COLD)
        except BaseException:
            self.close(kind)
            raise
        fl.timings["dev_up_s"] = time.monotonic() - began
        e2e.logger.info("shared %s cluster: bring-up %d", kind, self._bring_ups[kind])
        return fl

    def release(self, kind: str, request: pytest.FixtureRequest) -> None:
        """After a module: down with the cluster unless a later test of the run uses it."""
        shared = self._up.get(kind)
        if shared is None:
            return
        e2e.logger.info(
            "e2e timings: %s", json.dumps({k: round(v, 1) for k, v in shared.fleet.timings.items()})
        )
        items = request.session.items
        mine = [i for i, item in enumerate(items) if item.module is request.module]
        later = items[max(mine) + 1 :] if mine else []
        if not any(uses_shared(item, kind) for item in later):
            self.close(kind)

    def close(self, kind: str) -> None:
        """``dev down`` of the ``kind`` cluster (nothing left running), if it is up."""
        shared = self._up.pop(kind, None)
        if shared is not None:
            e2e.tear_down(shared.directory)


def uses_shared(item: pytest.Item, kind: str) -> bool:
    """Whether ``item`` uses the shared cluster ``kind``: judged by where its fixture is defined
    (``tests.e2e.conftest``, re-exported by tests/docs), not by the name alone: another tier's
    fixture may be called ``fleet`` too (tests/server/test_trainer_fleet.py was once moved in
    among these modules, beside a dev cluster it never used)."""
    info = getattr(item, "_fixtureinfo", None)  # pytest keeps the resolved fixtures here
    definitions = info.name2fixturedefs.get(kind, ()) if info is not None else ()
    return bool(definitions) and definitions[-1].func.__module__ == "tests.e2e.conftest"


#: The clusters of this test run (one module object: ``tests.e2e.shared_fleet``).
POOL = SharedFleets()
