"""weightroll's engine side: the vLLM worker extension, the pod sidecar and their wire protocol.

* ``engine_agent.vllm_extension`` — ``WeightRollExtension``, loaded into every vLLM rank with
  ``--worker-extension-cls engine_agent.vllm_extension.WeightRollExtension``.
* ``engine_agent.reload`` — the verified modulewise reload the extension runs (torch/vLLM).
* ``engine_agent.sidecar`` — ``weightroll-agent``, the per-pod HTTP server (no torch/vLLM).
* ``engine_agent.protocol`` — wire models shared with the operator.
"""

__all__: list[str] = []
