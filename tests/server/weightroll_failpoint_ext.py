"""TEST-ONLY worker extension: ``WeightRollExtension`` whose failpoints can change at run time.

``engine_agent.reload.failpoints`` reads ``WEIGHTROLL_FAILPOINTS`` from the rank's environment,
which cannot be changed from outside a running vLLM. This subclass copies the content of the
file named by ``WEIGHTROLL_FAILPOINTS_FILE`` into that variable before every call, so one server
can serve a happy path and then a rank that fails or hangs. Never used outside ``tests/server``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine_agent.vllm_extension import WeightRollExtension


class FailpointFileExtension(WeightRollExtension):
    def _weightroll_sync_failpoints(self) -> None:
        path = os.environ.get("WEIGHTROLL_FAILPOINTS_FILE")
        text = ""
        if path:
            try:
                text = Path(path).read_text().strip()
            except OSError:
                text = ""
        os.environ["WEIGHTROLL_FAILPOINTS"] = text

    def weightroll_begin(self, spec_json: str) -> dict[str, Any]:
        self._weightroll_sync_failpoints()
        return super().weightroll_begin(spec_json)

    def weightroll_load(self, source_json: str) -> dict[str, Any]:
        self._weightroll_sync_failpoints()
        return super().weightroll_load(source_json)

    def weightroll_finish(self, args_json: str = "{}") -> dict[str, Any]:
        self._weightroll_sync_failpoints()
        return super().weightroll_finish(args_json)

    def weightroll_abort(self, args_json: str = "{}") -> dict[str, Any]:
        self._weightroll_sync_failpoints()
        return super().weightroll_abort(args_json)

    def weightroll_state(self, args_json: str = "{}") -> dict[str, Any]:
        self._weightroll_sync_failpoints()
        return super().weightroll_state(args_json)
