"""The per-rank weight state machine (engine-reload.md R3): pure, no torch.

States and transitions::

    CLEAN(v) --begin--> OPEN(base=v) --first live write--> DIRTY --finish ok--> CLEAN(v')
    OPEN  --finish fails / abort--> CLEAN(v)         (no live byte changed: still exactly v)
    DIRTY --finish fails / abort--> POISONED          (live bytes are a mix of v and v')
    any state --poison (the coordinator saw another rank write)--> POISONED
    POISONED --begin(full)--> OPEN(poisoned) --finish ok--> CLEAN(v')
    OPEN(poisoned) --finish fails / abort--> POISONED

Prefetch (issue 30) is not a state: a rank reading an update's checkpoint into host staging
keeps serving what it served, so ``prefetched`` only names the update whose staging it holds::

    CLEAN(v) --prefetch--> CLEAN(v, prefetched=u) --begin(u)--> OPEN(prefetched=u)
             --apply (staging consumed)--> OPEN --first live write--> DIRTY ...
    CLEAN(v, prefetched=u) --drop (failure or abort before the drain)--> CLEAN(v)

Invariants (gap 1 of the mission):
    * Only :func:`commit` produces ``CLEAN`` with a new version, and the caller may call it only
      after coverage, derived-state refresh and identity checks all passed. A session that
      wrote nothing can never commit (the coverage check fails), so an empty begin/finish after
      a failed update leaves the engine POISONED.
    * A poisoned engine accepts only a *full* update: a partial or sparse update would take the
      mixed state as its base.
    * A partial or sparse update (a delta) is accepted only from ``CLEAN`` at exactly its
      ``base_version``, serving exactly the commit it names (``base_update_id``, ``None`` for
      the boot weights): a vLLM restarted onto boot weights labelled like that commit is not
      its base.
    * ``serving_safe`` is true in ``CLEAN`` only.
    * A session is its update id *and* its spec: a repeated begin of the open session with the
      same spec is acknowledged (a retried call), with another spec it is a conflict, open or
      dirty — acknowledging it would let the caller believe the rank writes what it asked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine_agent.errors import InvalidRequest, UpdateConflict, WrongState
from engine_agent.protocol import EngineState, UpdateMode, UpdateSpec

__all__ = [
    "WeightState",
    "abort",
    "begin",
    "commit",
    "drop_prefetch",
    "fail",
    "initial",
    "mark_written",
    "poison",
    "prefetch",
]


@dataclass(frozen=True, slots=True)
class WeightState:
    state: EngineState
    #: The version every weight belongs to while CLEAN; the last committed one otherwise.
    version: str
    update_id: str | None = None
    mode: UpdateMode | None = None
    target_version: str | None = None
    #: The session was opened on a poisoned engine: failing it keeps the engine poisoned.
    began_poisoned: bool = False
    poison_reason: str | None = None
    #: The session whose commit produced the weights this rank serves (``None``: the boot
    #: weights). Lives in the rank process, so a vLLM restarted onto boot weights labelled like
    #: the last commit is still told apart from that commit (the label alone cannot).
    committed_by: str | None = None
    #: The spec the open session began with (a repeated begin must repeat it exactly).
    spec: UpdateSpec | None = None
    #: The update whose checkpoint this rank holds (or reads) in host staging, not yet applied.
    #: Says nothing about what the rank serves: ``serving_safe`` is unchanged by a prefetch.
    prefetched: str | None = None

    @property
    def serving_safe(self) -> bool:
        return self.state is EngineState.CLEAN

    @property
    def in_session(self) -> bool:
        return self.state in (EngineState.OPEN, EngineState.DIRTY)


def initial(version: str) -> WeightState:
    """The state of a freshly loaded engine: clean at its boot version."""
    return WeightState(state=EngineState.CLEAN, version=version)


def begin(ws: WeightState, spec: UpdateSpec) -> WeightState:
    """Open a session for ``spec``.

    Raises:
        UpdateConflict: another session is open, or the open one began with another spec (a
            repeated begin of the open session with the same spec is accepted and returns
            ``ws`` unchanged).
        WrongState: the engine is poisoned and the update is not full, or a delta's base
            (``base_version``, ``base_update_id``) is not what the engine serves.
    """
    if ws.in_session:
        if ws.update_id == spec.update_id and ws.spec == spec:
            return ws
        if ws.update_id == spec.update_id:
            raise UpdateConflict(
                f"update {spec.update_id!r} is active ({ws.state.value}) with another spec "
                f"({_spec_difference(ws.spec, spec)}); an update id names one request, so send "
                "the new one under a new id after finishing or aborting this one",
                field="update_id",
            )
        raise UpdateConflict(
            f"update {ws.update_id!r} is active ({ws.state.value}); finish or abort it before "
            f"starting {spec.update_id!r}",
            field="update_id",
        )
    if ws.prefetched is not None and ws.prefetched != spec.update_id:
        raise UpdateConflict(
            f"update {ws.prefetched!r} is prefetched on this rank; abort it before starting "
            f"{spec.update_id!r}",
            field="update_id",
        )
    _check_base(ws, spec)
    return replace(
        ws,
        state=EngineState.OPEN,
        update_id=spec.update_id,
        mode=spec.mode,
        target_version=spec.version,
        began_poisoned=ws.state is EngineState.POISONED,
        spec=spec,
    )


def prefetch(ws: WeightState, spec: UpdateSpec) -> WeightState:
    """Note that this rank stages ``spec``'s checkpoint ahead of its session; what it serves
    (state, version, ``serving_safe``) is unchanged.

    The checks :func:`begin` will make are made now too, so a prefetch that could never be
    applied is refused before any byte is read; :func:`begin` makes them again in the drain.

    Raises:
        UpdateConflict: a session is open, or another update is prefetched (the same one again
            is acknowledged, ``ws`` unchanged).
        InvalidRequest: a sparse update (applied in place, nothing to stage ahead).
        WrongState: as :func:`begin` for a poisoned engine or a delta's base.
    """
    if ws.in_session:
        raise UpdateConflict(
            f"update {ws.update_id!r} is active ({ws.state.value}); a prefetch of "
            f"{spec.update_id!r} must come before its session",
            field="update_id",
        )
    if ws.prefetched == spec.update_id:
        return ws
    if ws.prefetched is not None:
        raise UpdateConflict(
            f"update {ws.prefetched!r} is prefetched on this rank; abort it before prefetching "
            f"{spec.update_id!r}",
            field="update_id",
        )
    if spec.mode is UpdateMode.SPARSE:
        raise InvalidRequest(
            "a sparse update cannot be prefetched: its patch is planned against and written "
            "into the live bytes inside the drain",
            field="prefetch",
        )
    _check_base(ws, spec)
    return replace(ws, prefetched=spec.update_id)


def drop_prefetch(ws: WeightState) -> WeightState:
    """The staging was consumed (applied) or freed (a failure or abort before the drain)."""
    return replace(ws, prefetched=None)


def _check_base(ws: WeightState, spec: UpdateSpec) -> None:
    """Refuse a delta that does not build on exactly what the engine serves, and anything but a
    full update on a poisoned engine (:func:`begin`)."""
    if ws.state is EngineState.POISONED and spec.mode is not UpdateMode.FULL:
        raise WrongState(
            f"engine is poisoned ({ws.poison_reason}); only a full update can recover it, "
            f"a {spec.mode.value} update would build on mixed weights",
            field="mode",
        )
    if spec.mode is not UpdateMode.FULL and spec.base_version != ws.version:
        raise WrongState(
            f"{spec.mode.value} update is based on {spec.base_version!r} but the engine serves "
            f"{ws.version!r}; send a full update or a delta against {ws.version!r}",
            field="base_version",
        )
    if spec.mode is not UpdateMode.FULL and spec.base_update_id != ws.committed_by:
        raise WrongState(
            f"{spec.mode.value} update builds on the weights committed by "
            f"{_commit_name(spec.base_update_id)}, but the engine serves those of "
            f"{_commit_name(ws.committed_by)} (labelled {ws.version!r}); send a full update",
            field="base_update_id",
        )


def mark_written(ws: WeightState) -> WeightState:
    """Record that a live byte is about to change: OPEN becomes DIRTY."""
    if not ws.in_session:
        raise WrongState(f"no update session is open (engine is {ws.state.value})")
    return replace(ws, state=EngineState.DIRTY)


def commit(ws: WeightState) -> WeightState:
    """Close the session successfully: the engine serves ``target_version``.

    The caller must have verified coverage, derived state and identity first.
    """
    if not ws.in_session or ws.target_version is None:
        raise WrongState(f"no update session is open (engine is {ws.state.value})")
    return WeightState(
        state=EngineState.CLEAN, version=ws.target_version, committed_by=ws.update_id
    )


def fail(ws: WeightState, reason: str) -> WeightState:
    """Close the session unsuccessfully.

    An untouched session on a clean engine leaves it clean at its old version; anything that
    changed live bytes, or started from a poisoned engine, leaves it poisoned.
    """
    if not ws.in_session:
        return ws
    if ws.state is EngineState.DIRTY or ws.began_poisoned:
        reason = reason if ws.state is EngineState.DIRTY else (ws.poison_reason or reason)
        return replace(ws, state=EngineState.POISONED, poison_reason=reason)
    return WeightState(state=EngineState.CLEAN, version=ws.version, committed_by=ws.committed_by)


def _spec_difference(began: UpdateSpec | None, repeated: UpdateSpec) -> str:
    """The fields in which ``repeated`` differs from the spec the session ``began`` with."""
    if began is None:
        return "the spec it began with is unknown"
    old, new = began.model_dump(by_alias=True), repeated.model_dump(by_alias=True)
    return ", ".join(
        f"{key}: {old[key]!r} began, {new[key]!r} now" for key in old if old[key] != new[key]
    )


def _commit_name(update_id: str | None) -> str:
    return "its boot load" if update_id is None else repr(update_id)


def abort(ws: WeightState) -> WeightState:
    """Abort the session: the same outcome as a failure, with the reason "aborted"."""
    return fail(ws, f"update {ws.update_id!r} was aborted after writing live weights")


def poison(ws: WeightState, reason: str) -> WeightState:
    """Poison the rank whatever its own state: another rank of the same replica wrote live
    weights in a session that did not commit, so the replica as a whole is mixed.
    """
    return WeightState(
        state=EngineState.POISONED,
        version=ws.version,
        update_id=ws.update_id,
        poison_reason=reason,
        committed_by=ws.committed_by,
    )
