"""Issue 30, the drained window: a prefetched update's post-load runs on shadow modules.

One real engine (dense Llama, TP=1, packed CPU GEMM kernels as in tests/engine/test_census.py,
so each linear's kernel keeps a private copy of its weight). While the rank serves, the poll
that finds the read done routes the staged tensors and runs every module's post-load step on a
shadow: the live kernels are untouched until the drain. Inside it, ``apply`` installs the
shadows' kernels and copies their tensors into the live storage, and afterwards nothing of the
staging — shadows, staged tensors, the kernels they replaced — is still held (weak references).
The census test (tests/engine/test_census.py) judges the bytes against a cold engine.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.harness.engines import Engine, cold_outputs, environ, start_engine
from tests.harness.probe_extension import PACKED_GEMM_ENV


def _rank(engine: Engine) -> Any:
    return engine.llm.llm_engine.model_executor.driver_worker.worker._weightroll_engine()


def _prefetch(engine: Engine, update_id: str, version: str, path: Path) -> dict[str, Any]:
    body = {"updateId": update_id, "version": version}
    started = engine.rpc("weightroll_prefetch", {"spec": body, "source": {"path": str(path)}})
    assert started[0]["ok"], started
    deadline = time.monotonic() + 120
    while True:
        (polled,) = engine.rpc("weightroll_prefetched")
        if not polled["ok"] or polled["prefetch"] == "ready":
            return polled
        assert time.monotonic() < deadline, polled
        time.sleep(0.05)


def _weak_staging(rank: Any) -> tuple[list[Any], list[str]]:
    """Weak references to everything the prefetch holds for the drain, and the shadowed
    linears' names."""
    prepared = rank._prefetch.prepared
    assert prepared is not None, "the post-load steps ran before the drain"
    refs: list[Any] = []
    for shadow in prepared.processor.shadows:
        refs.append(weakref.ref(shadow.shadow))
        refs += [weakref.ref(t) for t in shadow.shadow._parameters.values() if t is not None]
    names = [s.name for s in prepared.processor.shadows if s.name.endswith("_proj")]
    return refs, names


def test_the_drain_installs_kernels_built_before_it_and_holds_no_staging(
    checkpoints: Callable[[str, int], Path],
) -> None:
    a, b = checkpoints("llama", 0), checkpoints("llama", 1)
    with environ({PACKED_GEMM_ENV: "1"}):
        cold_b = cold_outputs(b)
        engine = start_engine(a)
        try:
            boot = engine.outputs()
            model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
            modules = dict(model.named_modules())
            polled = _prefetch(engine, "pf-b", "b", b)
            assert polled["ok"], polled
            rank = _rank(engine)
            assert rank._prefetch.prepared.in_window == {}, "a dense Llama needs no module in it"
            # the unfused tensors (embedding, o_proj, down_proj, norms, LM head) were staged in
            # their read buffers; the census below and the seal judge the bytes
            assert 0 < rank._prefetch.prepared.bytes_adopted < rank._prefetch.prepared.bytes_loaded
            refs, linears = _weak_staging(rank)
            assert linears, "the linears were processed on shadows"
            kernels = {n: modules[n].__dict__["cpu_linear"] for n in linears}
            shadowed = {
                s.name: s.shadow.__dict__["cpu_linear"]
                for s in rank._prefetch.prepared.processor.shadows
                if s.name in kernels
            }
            # prefetched: the live kernels are still the boot ones, and the rank serves them
            assert engine.outputs() == boot
            assert all(kernels[n] is not shadowed[n] for n in linears)
            old_kernels = [weakref.ref(k) for k in kernels.values()]
            del kernels, rank
            for method, payload in (
                ("weightroll_begin", {"updateId": "pf-b", "version": "b"}),
                ("weightroll_apply", {}),
                ("weightroll_finish", {}),
            ):
                (report,) = engine.rpc(method, payload)
                assert report["ok"], report
            # the drain handed over the kernels built on the shadows, and the shadows are gone
            assert all(modules[n].__dict__["cpu_linear"] is shadowed[n] for n in linears)
            del shadowed
            gc.collect()
            assert [r for r in refs if r() is not None] == [], "staging still held"
            assert [r for r in old_kernels if r() is not None] == [], "replaced kernels held"
            # what a cold engine on b serves, adopted read buffers and shadow kernels included
            assert engine.outputs() == cold_b != boot
            # the seal took the digests computed on the shadows: the live bytes match them
            assert _rank(engine).guard.violations(force_content=True) == []
        finally:
            engine.close()


def test_a_prefetch_whose_shadow_post_load_fails_frees_it_and_serves_on(
    checkpoints: Callable[[str, int], Path], monkeypatch: Any
) -> None:
    """The post-load step of a shadow fails: the prefetch fails, nothing live was written."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    a, b = checkpoints("llama", 0), checkpoints("llama", 1)
    engine = start_engine(a)
    try:
        boot = engine.outputs()
        (before,) = engine.state()
        original = UnquantizedLinearMethod.process_weights_after_loading
        seen: list[Any] = []

        def fail_second(self: Any, layer: Any) -> None:
            seen.append(weakref.ref(layer))
            original(self, layer)
            if len(seen) == 2:
                raise RuntimeError("injected: out of memory while packing")

        monkeypatch.setattr(UnquantizedLinearMethod, "process_weights_after_loading", fail_second)
        polled = _prefetch(engine, "pf-fail", "b", b)
        monkeypatch.undo()
        assert not polled["ok"] and "out of memory" in polled["error"]["message"], polled
        (state,) = engine.state()
        assert state["state"] == "clean" and state["version"] == before["version"], state
        assert _rank(engine)._prefetch is None
        gc.collect()
        assert [r for r in seen if r() is not None] == [], "the failed shadows are still held"
        assert engine.outputs() == boot
    finally:
        engine.close()
