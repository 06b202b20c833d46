""" "Still true now" (issue 26 E): is what the kernels read still what this rank committed?

A commit establishes that every kernel-visible tensor holds exactly what a cold engine on the
version would hold. Nothing in vLLM keeps it so: its own ``reload_weights`` (reachable through
``collective_rpc`` on the pod-local dev routes), a sleep/wake that restores other bytes, or any
stray in-place write changes live bytes while the rank would go on reporting ``clean``. The
guard seals the state at each commit and re-checks it:

* **identity, on every state answer** (cheap: pointers and kernel tags, no byte read): every
  tensor of the seal still lives where it lived, with its layout, and every module still runs
  the kernel it ran (:mod:`engine_agent.reload.identity`);
* **content, when due** (every ``period`` seconds, checked on the state answer that finds it
  due, so a replica in traffic is judged at least as often as the operator asks): a digest of
  every sealed tensor where it lives (:func:`~engine_agent.reload.digest.tensor_digest`:
  BLAKE3 over host memory on CPU, a torch reduction on the device elsewhere), compared with
  the seal's; and for kernels that keep a private copy of their weight (oneDNN's packed
  GEMM on AVX-512/AMX CPUs leaves the parameter empty), a digest of what the kernel computes on
  a fixed probe input: the only view of bytes behind an opaque handle. That view is one
  matrix-vector product per kernel (the cost of reading the weight once); it sees any overwrite
  of a weight but, through the output's rounding, not every single-ulp change.

A violation names the first tensors that changed; the rank engine then poisons itself (only a
full update re-establishes the promise) and the agent fences the replica.

The cost is one read of the rank's weights per period: at the default 30 s and BLAKE3's few
GB/s on one core that is under 1 % of serving time for a rank holding up to ~1 GB on CPU; a
GPU reads its memory at TB/s. ``bench/reload.py`` reports the measured figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from engine_agent.protocol import STILL_TRUE_VIOLATED
from engine_agent.reload.digest import tensor_digest
from engine_agent.reload.identity import (
    StorageRecord,
    compare_kernels,
    compare_storage,
    storage_record,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_PERIOD_S", "PROBED", "Seal", "StillTrueGuard", "kernel_probe", "kernel_probes"]

#: Seconds between content checks by default (issue 26 E: detection within 30 s).
DEFAULT_PERIOD_S: Final = 30.0
#: Tensors named in one violation message, at most.
_MAX_NAMED: Final = 3


@dataclass(frozen=True, slots=True)
class Seal:
    """What the kernels read at the moment of a commit."""

    storage: Mapping[str, StorageRecord]
    kernels: Mapping[str, str]
    digests: Mapping[str, str]


@dataclass(eq=False)
class StillTrueGuard:
    """Seal a committed state; say whether it is still the state the kernels read.

    Args:
        tensors: every kernel-visible tensor by name (the rank's index: parameters, buffers,
            registered derived tensors), read afresh on each call.
        kernels: every module's kernel tag (:func:`~engine_agent.reload.identity.kernel_tag`).
        period: seconds between content checks; 0 checks content on every call.
        clock: monotonic seconds (injected by tests).
    """

    tensors: Callable[[], Mapping[str, torch.Tensor]]
    kernels: Callable[[], Mapping[str, str]]
    #: What kernels that keep private copies compute (read only when content is checked), but
    #: for the names it is handed (their digests are known).
    observations: Callable[[Collection[str]], Mapping[str, torch.Tensor]] = lambda _known: {}
    period: float = DEFAULT_PERIOD_S
    clock: Callable[[], float] = time.monotonic
    _seal: Seal | None = field(default=None, init=False)
    _content_due: float = field(default=0.0, init=False)
    #: Seconds the last content check took (reported beside the rank's state; the bench's figure).
    last_check_seconds: float = field(default=0.0, init=False)
    content_checks: int = field(default=0, init=False)

    @property
    def sealed(self) -> bool:
        return self._seal is not None

    def seal(self, known: Mapping[str, str] | None = None) -> None:
        """Record what the kernels read now (call right after a commit, before serving).

        ``known``: digests of what some tensors (and observations) must hold now, computed
        before the commit from the very bytes that were copied into them (a prefetched update's
        shadows, :mod:`.shadow`); they are not read again here. The first content check reads
        them and compares with these, so a copy that went wrong is still caught, one period
        later at most — where digesting the live bytes here would have sealed it.
        """
        tensors = self.tensors()
        self._seal = Seal(
            storage={name: storage_record(t) for name, t in tensors.items()},
            kernels=dict(self.kernels()),
            digests=self._digests(tensors, known or {}),
        )
        self._content_due = self.clock() + self.period

    def unseal(self) -> None:
        """Forget the seal (a session opened: the live bytes are about to change on purpose)."""
        self._seal = None

    def violations(self, *, force_content: bool = False) -> list[str]:
        """What changed since the seal (empty: still true). Identity always, content when due.

        Unsealed, nothing is claimed and nothing is checked.
        """
        seal = self._seal
        if seal is None:
            return []
        tensors = self.tensors()
        current = {name: storage_record(t) for name, t in tensors.items()}
        problems = compare_storage(seal.storage, current)
        problems += compare_kernels(seal.kernels, self.kernels())
        if problems:
            return problems
        now = self.clock()
        if not force_content and now < self._content_due:
            return []
        started = time.perf_counter()
        digests = self._digests(tensors, {})
        changed = [
            f"{name}: content changed since the commit"
            for name in sorted(seal.digests.keys() | digests.keys())
            if digests.get(name) != seal.digests.get(name)
        ]
        self.last_check_seconds = time.perf_counter() - started
        self.content_checks += 1
        self._content_due = now + self.period
        return changed

    def _digests(
        self, tensors: Mapping[str, torch.Tensor], known: Mapping[str, str]
    ) -> dict[str, str]:
        digests = {name: known.get(name) or tensor_digest(t) for name, t in tensors.items()}
        digests |= {name: tensor_digest(t) for name, t in self.observations(known).items()}
        return digests | {name: d for name, d in known.items() if name.endswith(PROBED)}

    @staticmethod
    def describe(problems: list[str]) -> str:
        """One bounded line naming the first changed tensors (for the poison reason)."""
        named = "; ".join(problems[:_MAX_NAMED])
        more = f" (and {len(problems) - _MAX_NAMED} more)" if len(problems) > _MAX_NAMED else ""
        return f"{STILL_TRUE_VIOLATED}: {named}{more}"


#: Seed of the fixed probe input every kernel observation uses (the same on every check).
_PROBE_SEED: Final = 20261206


#: How an observation is named: ``<module>`` + this.
PROBED: Final = ".cpu_linear(probe)"


def kernel_probes(
    model: torch.nn.Module, known: Collection[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """What each CPU GEMM kernel with a private weight copy computes on a fixed probe input.

    vLLM's oneDNN path (AVX-512/AMX CPUs) packs a linear's weight behind an opaque handle and
    leaves the parameter empty, so no tensor shows those bytes; the kernel's output on a fixed
    input is the view of them the guard compares. A kernel without captured state (the fallback
    that reads the live parameter) is covered by the parameter itself and skipped.
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if f"{name}{PROBED}" in known:
            continue
        observed = kernel_probe(module)
        if observed is not None:
            out[f"{name}{PROBED}"] = observed
    return out


def kernel_probe(module: torch.nn.Module) -> torch.Tensor | None:
    """What ``module``'s CPU GEMM kernel computes on the fixed probe input (``None``: it has no
    kernel with a private weight copy); :func:`kernel_probes`."""
    import torch

    kernel = module.__dict__.get("cpu_linear")
    weight = module._parameters.get("weight")
    if kernel is None or weight is None or not getattr(kernel, "__closure__", None):
        return None
    width = int(weight.shape[1]) if weight.ndim == 2 and weight.numel() else 0
    width = width or int(getattr(module, "input_size_per_partition", 0) or 0)
    if not width:
        return None
    generator = torch.Generator().manual_seed(_PROBE_SEED + width)
    probe = torch.randn(1, width, generator=generator).to(weight.dtype).to(weight.device)
    with torch.no_grad():
        observed: torch.Tensor = kernel(probe, weight, None)
    return observed
