"""Issue 14 D: the operator re-reads its projected ServiceAccount token when it changes.

Kubelet rotates a bound token by replacing the file (atomically, a new inode). The operator's API
client must send the new token on its next call, and kopf's login handler must hand the new one
to kopf's watches. The API here is a real aiohttp server that records the Authorization header.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiohttp import web
from weightroll_operator.k8s.client import KubeApi, KubeConfig
from weightroll_operator.main import _login


@pytest.mark.asyncio
async def test_replaced_token_file_is_used_by_the_next_call(tmp_path: Path) -> None:
    seen: list[str] = []

    async def pods(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"kind": "PodList", "items": []})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods", pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    token = tmp_path / "token"
    token.write_text("token-one\n")
    cfg = KubeConfig(server=f"http://127.0.0.1:{port}", token_file=str(token))
    kube = KubeApi(cfg)
    try:
        await kube.list_pods("ns")
        assert _login(cfg, kube).token == "token-one"
        fresh = tmp_path / "token.new"
        fresh.write_text("token-two\n")
        os.replace(fresh, token)  # what kubelet's atomic writer does
        await kube.list_pods("ns")
        assert _login(cfg, kube).token == "token-two"
        assert _login(cfg, kube).expiration is not None  # kopf asks again before long
        assert seen == ["Bearer token-one", "Bearer token-two"]
    finally:
        await kube.close()
        await runner.cleanup()


def test_in_cluster_config_names_the_token_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = KubeConfig.load()
    assert cfg.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert cfg.token is None  # never a copy read once at start
