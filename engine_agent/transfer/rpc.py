"""The extension RPCs the agent uses around vLLM's native weight-transfer routes.

Mixed into :class:`~engine_agent.vllm_extension.WeightRollExtension` (so ``self`` is the vLLM
worker). vLLM's ``/finish_weight_update`` answers only a message and its ``collective_rpc``
raises on the first failing rank (vLLM #60928), so the agent reads every rank's own answer
through these methods, which **never raise**: each returns a ``RankReport`` dict (an error is
``ok: false`` with a code).

``weightroll_transfer_check_init(init_info)``
    Whether this rank would accept a trainer's ``init_info``: a weightroll backend, and a
    rendezvous inside this rank's trainer networks (``WEIGHTROLL_TRAINER_NETWORKS``). The agent
    asks every rank before it forwards ``/init_weight_transfer_engine``, so a stock backend
    (whose NCCL rendezvous unpickles what the peer publishes) is never handed one.
``weightroll_transfer_arm(spec)``
    The next ``start_weight_update`` on this rank opens exactly ``spec`` (an ``UpdateSpec``:
    the agent names the session, the same on every rank). Also clears vLLM's own
    "update active" flag when this rank has no open session (left set by a failed finish,
    which vLLM keeps open for a retry that can never succeed), so a recovering full update can
    start.
``weightroll_transfer_commit_as({"version"})``
    Names the version the open session commits as (a trainer names it only at finish).
``weightroll_transfer_report({})``
    This rank's last report of the push (the finish report after ``/finish_weight_update``).
``weightroll_transfer_fence({"reason"})``
    Poisons the rank (the replica fence) and clears vLLM's update flag; only a full update
    that commits brings it back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine_agent.protocol import ErrorBody, ExtensionRpc, RankId, RankReport, UpdateSpec
from engine_agent.transfer.rendezvous import RendezvousRefused

__all__ = ["TransferRpcMixin"]

logger = logging.getLogger(__name__)


def _refused(code: str, message: str, state: dict[str, Any] | None) -> dict[str, Any]:
    status = state or {}
    return RankReport(
        rank=status.get("rank") or RankId(dp=0, pp=0, tp=0),
        call="transfer",
        ok=False,
        state=status.get("state", "poisoned"),
        version=status.get("version", ""),
        update_id=status.get("updateId"),
        error=ErrorBody(code=code, message=message),
    ).to_wire()


class TransferRpcMixin:
    """``weightroll_transfer_*`` methods; see the module docstring."""

    def _weightroll_transfer(self) -> Any:
        """This worker's weightroll backend, or ``None`` (another backend, or none)."""
        from engine_agent.transfer.backend import VerifiedBackendMixin

        backend = getattr(self, "weight_transfer_engine", None)
        return backend if isinstance(backend, VerifiedBackendMixin) else None

    def _weightroll_transfer_call(self, method: ExtensionRpc, body: Any) -> dict[str, Any]:
        this: Any = self
        state: dict[str, Any] | None = None
        try:
            state = this._weightroll_engine().status()
            backend = self._weightroll_transfer()
            if backend is None:
                name = type(getattr(self, "weight_transfer_engine", None)).__name__
                return _refused(
                    "wrong_state",
                    f"the weight-transfer backend is {name}, not a weightroll backend; start "
                    'vLLM with --weight-transfer-config \'{"backend": "weightroll_gloo"}\' '
                    "(or weightroll_nccl / weightroll_ipc)",
                    state,
                )
            result: dict[str, Any] = body(backend)
            return result
        except Exception as e:  # never raise: the agent counts every rank's answer
            logger.exception("%s failed", method)
            return _refused("internal", f"{type(e).__name__}: {e}", state)

    def _weightroll_clear_vllm_flag(self) -> None:
        this: Any = self
        if getattr(this, "_weight_update_active", False):
            this._weight_update_active = False
            backend = self._weightroll_transfer()
            if backend is not None:
                backend.reset_weight_update_target()

    def weightroll_transfer_check_init(self, init_info_json: str) -> dict[str, Any]:
        """Check a trainer's ``init_info`` as this rank's backend will (never contacts anyone)."""

        def check(backend: Any) -> dict[str, Any]:
            this: Any = self
            engine = this._weightroll_engine()
            try:
                backend.check_rendezvous(json.loads(init_info_json or "{}"))
            except RendezvousRefused as e:
                return _refused(e.code, str(e), engine.status())
            return RankReport(
                rank=engine.rank,
                call="check_init",
                ok=True,
                state=engine.state.state,
                version=engine.state.version,
            ).to_wire()

        return self._weightroll_transfer_call(ExtensionRpc.TRANSFER_CHECK_INIT, check)

    def weightroll_transfer_arm(self, spec_json: str) -> dict[str, Any]:
        """Arm the next ``start_weight_update`` with ``spec`` (see the module docstring)."""

        def arm(backend: Any) -> dict[str, Any]:
            this: Any = self
            engine = this._weightroll_engine()
            spec = UpdateSpec.model_validate_json(spec_json)
            if not engine.state.in_session:
                self._weightroll_clear_vllm_flag()
            backend.weightroll.arm(spec)
            return RankReport(
                rank=engine.rank,
                call="arm",
                ok=True,
                state=engine.state.state,
                version=engine.state.version,
                update_id=spec.update_id,
            ).to_wire()

        return self._weightroll_transfer_call(ExtensionRpc.TRANSFER_ARM, arm)

    def weightroll_transfer_commit_as(self, args_json: str) -> dict[str, Any]:
        """Name the version the open session commits as."""
        version = str(json.loads(args_json or "{}").get("version", ""))
        return self._weightroll_transfer_call(
            ExtensionRpc.TRANSFER_COMMIT_AS, lambda backend: backend.weightroll.retarget(version)
        )

    def weightroll_transfer_report(self, args_json: str = "{}") -> dict[str, Any]:
        """This rank's last report of the push (``wrong_state`` when it has none)."""

        def report(backend: Any) -> dict[str, Any]:
            last: dict[str, Any] | None = backend.weightroll.last
            if last is None:
                this: Any = self
                return _refused(
                    "wrong_state", "no push reached this rank", this._weightroll_engine().status()
                )
            return last

        return self._weightroll_transfer_call(ExtensionRpc.TRANSFER_REPORT, report)

    def weightroll_transfer_fence(self, args_json: str = "{}") -> dict[str, Any]:
        """Poison this rank and clear vLLM's update flag (the replica fence)."""
        reason = str(json.loads(args_json or "{}").get("reason") or "fenced by the agent")

        def fence(backend: Any) -> dict[str, Any]:
            report: dict[str, Any] = backend.weightroll.poison(reason)
            self._weightroll_clear_vllm_flag()
            return report

        return self._weightroll_transfer_call(ExtensionRpc.TRANSFER_FENCE, fence)
