"""Spec -> agent wire: the ``UpdateRequest`` one pod's operation sends, and the webhook's check.

Apart from the planner so that the admission webhook validates a spec without importing it.
It sits in ``domain``, not in ``api`` (where the layout first put it), because it reads the
pod's :class:`~weightroll_operator.domain.model.WeightState` (the attempt id, the recorded
rollback source), and ``api`` sits below ``domain`` in the ``operator-layers`` contract.
"""

from __future__ import annotations

from pydantic import ValidationError

from engine_agent.protocol import DrainMode as WireDrainMode
from engine_agent.protocol import DrainSpec as WireDrainSpec
from engine_agent.protocol import PrefetchMode as WirePrefetchMode
from engine_agent.protocol import PrefetchSpec as WirePrefetchSpec
from engine_agent.protocol import SourceSpec as WireSourceSpec
from engine_agent.protocol import UpdateMode, UpdateRequest
from weightroll_operator.api.v1alpha1 import PrefetchMode, SourceMode, WeightUpdateSpec
from weightroll_operator.domain.model import (
    OwnerKey,
    UnitState,
    WeightState,
    make_update_id,
)

__all__ = ["build_request", "check_wire"]


def check_wire(spec: WeightUpdateSpec, name: str) -> None:
    """Specs the CRD schema cannot check: the source must be expressible on the agent wire.

    Raises:
        ValueError: naming ``spec.source`` (or ``spec.strategy.prefetch``) and what the agent's
            protocol refuses in it.
    """
    if spec.strategy.prefetch.mode is PrefetchMode.HOST and spec.source.mode is SourceMode.SPARSE:
        raise ValueError(
            "spec.strategy.prefetch.mode: 'Host' is not supported for sparse sources (a patch "
            "is written into the live bytes inside the drain); use 'None'"
        )
    if (
        spec.strategy.prefetch.max_concurrent is not None
        and spec.strategy.prefetch.mode is not PrefetchMode.HOST
    ):
        raise ValueError(
            "spec.strategy.prefetch.maxConcurrent: bounds prefetches ahead of the drain, which "
            "only mode 'Host' runs; set mode 'Host' or remove it"
        )
    probe = WeightState(
        state=UnitState.DRAINING,
        by=OwnerKey("-"),
        version=spec.version,
        update_id=make_update_id(name, spec.version),
    )
    try:
        build_request(spec, probe)
    except ValidationError as e:
        message = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        raise ValueError(f"spec.source: {message}") from e


def build_request(
    spec: WeightUpdateSpec, st: WeightState, *, rollback: bool = False
) -> UpdateRequest:
    """The agent request for one pod's current operation.

    Raises:
        ValueError: if the source cannot be expressed on the wire (reported as InvalidSpec).
    """
    drain = WireDrainSpec(
        mode=WireDrainMode(spec.strategy.drain.mode.value),
        timeout_seconds=spec.strategy.drain.timeout_seconds,
    )
    host = spec.strategy.prefetch.mode is PrefetchMode.HOST
    # With Host the operator gives the go (``SwapUpdate``) once it drained the pod: the agent
    # parks in Prefetched, serving, until then, bounded by the update timeout.
    prefetch = WirePrefetchSpec(
        mode=WirePrefetchMode(spec.strategy.prefetch.mode.value),
        max_bytes=spec.strategy.prefetch.max_bytes,
        await_swap=host,
        swap_deadline_seconds=min(spec.strategy.update_timeout_seconds, 86400),
    )
    # A rollback goes back, in full, to the source recorded when the pod last committed.
    if rollback and st.previous_source is None:
        raise ValueError("no rollback source recorded")
    origin = st.previous_source if rollback and st.previous_source else spec.source
    sparse = not rollback and spec.source.mode is SourceMode.SPARSE
    return UpdateRequest(
        id=st.update_id,
        version=st.version,
        source=WireSourceSpec(
            uri=origin.uri, manifest=origin.manifest, manifest_digest=origin.manifest_digest
        ),
        mode=UpdateMode.SPARSE if sparse else UpdateMode.FULL,
        base_version=spec.source.base_version if sparse else None,
        drain=drain,
        prefetch=prefetch,
    )
