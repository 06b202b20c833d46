"""What every weightroll worker backend shares: the verified lifecycle around vLLM's engine ABC.

:class:`VerifiedBackendMixin` goes first in a backend's bases so its ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` replace the layerwise reload of vLLM's engines:

* ``update_weights`` resolves vLLM 0.33's empty-list NCCL update ("same metadata as the previous
  call", never "no weights"), receives, and on *any* exception fences the rank before re-raising
  — vLLM's worker drops its session without calling finish there, so the rank must not stay
  serveable on whatever the receive left behind;
* received tensors reach the verified session through :class:`Feeder`, which stands in for the
  model while vLLM's own receive code runs (it calls ``self.model.load_weights``). After a
  refused batch the feeder keeps swallowing the stream, so the collective with the trainer
  stays aligned instead of hanging, and the error is raised once the receive returns.
* before any backend contacts a peer (``init_transfer_engine``), :meth:`check_rendezvous`
  holds the init info to this rank's trainer networks (``WEIGHTROLL_TRAINER_NETWORKS``,
  :mod:`~engine_agent.transfer.rendezvous`), and ``update_weights`` refuses pickled payloads
  before vLLM's parser could unpickle them: the agent checks both first; this is the second
  line, for callers that reach vLLM's loopback routes directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from engine_agent.transfer.rendezvous import (
    WORKER_SETTING,
    check_init_info,
    check_update_info,
    networks_from_env,
)
from engine_agent.transfer.verified import VerifiedReceiver

__all__ = ["Feeder", "VerifiedBackendMixin", "same_metadata"]

_META_KEYS = ("names", "dtype_names", "shapes")


def same_metadata(update_info: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """Resolve an update whose ``names``/``dtype_names``/``shapes`` are all empty (vLLM 0.33).

    Such an update means "the same metadata as the previous call": the previous metadata is
    reused (and its tensors go through coverage again, so inside one session they are refused
    as duplicates). Without a previous call it is refused, never taken as "no weights".

    Raises:
        ValueError: an empty-metadata update with nothing to repeat.
    """
    if not all(key in update_info for key in _META_KEYS):
        return update_info
    if any(update_info[key] for key in _META_KEYS):
        return update_info
    if previous is None:
        raise ValueError(
            "update_weights with empty names/dtype_names/shapes repeats the previous update's "
            "metadata, but this engine received none yet"
        )
    return {**update_info, **{key: previous[key] for key in _META_KEYS}}


class Feeder:
    """Stands in for the model during a receive: ``load_weights`` feeds the verified session."""

    def __init__(self, receiver: VerifiedReceiver) -> None:
        self.receiver = receiver
        self.error: BaseException | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        batch = list(weights)  # drains generators even after an error
        if self.error is None:
            try:
                self.receiver.feed(batch)
            except Exception as e:
                self.error = e
        return {name for name, _ in batch}

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class VerifiedBackendMixin:
    """Mixed in front of a vLLM ``WeightTransferEngine`` subclass; see the module docstring."""

    #: Draft-model updates would need a second session per rank: refused (fail closed).
    supports_draft_weight_update: ClassVar[bool] = False
    #: Whether this backend's update info has NCCL's ``names/dtype_names/shapes`` lists.
    repeats_metadata: ClassVar[bool] = True

    _weightroll_receiver: VerifiedReceiver | None = None
    _weightroll_previous: dict[str, Any] | None = None

    @property
    def weightroll(self) -> VerifiedReceiver:
        """The rank's verified session (built on first use)."""
        if self._weightroll_receiver is None:
            this: Any = self
            self._weightroll_receiver = VerifiedReceiver(this._default_model, this.vllm_config)
        return self._weightroll_receiver

    def check_rendezvous(self, init_info: Mapping[str, Any]) -> None:
        """Refuse ``init_info`` unless its peer lies in this rank's trainer networks.

        Read from the environment on every call (the vLLM container's
        ``WEIGHTROLL_TRAINER_NETWORKS``; unset refuses every rendezvous).

        Raises:
            RendezvousRefused: see :func:`~engine_agent.transfer.rendezvous.check_init_info`.
        """
        check_init_info(init_info, networks_from_env(), setting=WORKER_SETTING)

    def start_weight_update(self) -> None:
        self.weightroll.start()

    def finish_weight_update(self) -> None:
        self.weightroll.finish()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        this: Any = self
        try:
            check_update_info(update_info)  # before vLLM's parser could unpickle anything
            if self.repeats_metadata:
                update_info = same_metadata(update_info, self._weightroll_previous)
                self._weightroll_previous = {key: update_info.get(key) for key in _META_KEYS}
            this.receive_weights(this.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()
        except BaseException as e:
            self.weightroll.poison(f"update_weights failed: {type(e).__name__}: {e}")
            raise

    def receive_through_feeder(self, receive: Any, update_info: Any) -> None:
        """Run vLLM's own ``receive`` with the model replaced by a :class:`Feeder`."""
        this: Any = self
        feeder = Feeder(self.weightroll)
        model = this.model
        this.model = feeder
        try:
            receive(update_info)
        finally:
            this.model = model
        feeder.raise_error()
