"""The trainer networks allow-list (``engine_agent.transfer.rendezvous``), table-driven.

Pure: no torch, no vLLM (the sidecar imports this module). The same checks on the real agent
process are ``tests/contract/agent/test_trainer_networks.py``; inside the worker backends,
``tests/unit/engine_agent/test_transfer.py``.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from engine_agent.sidecar.main import build_config, parse_args
from engine_agent.transfer.rendezvous import (
    RendezvousRefused,
    check_init_info,
    check_update_info,
    networks_from_env,
    parse_networks,
)

NETWORKS = parse_networks("10.20.0.0/16, 192.168.1.7 fd00:1::/64")


def _info(address: Any, **more: Any) -> dict[str, Any]:
    return {"master_address": address, "master_port": 29500, "world_size": 3, **more}


@pytest.mark.parametrize(
    "info",
    [
        _info("10.20.3.4"),
        _info("192.168.1.7", rank_offset=1, timeout_s=30.0, batch_bytes=1 << 20),
        _info("fd00:1::5", packed=True, packed_buffer_size_bytes=1 << 20, packed_num_buffers=2),
        _info("::ffff:10.20.0.9"),  # IPv4-mapped: judged as the IPv4 host it reaches
        {"packed": False},  # weightroll_ipc: no peer
        {**_info("10.20.3.4"), "nccl_unique_id_b64": None},  # unset, as vLLM's asdict has it
    ],
)
def test_a_peer_inside_the_trainer_networks_is_accepted(info: dict[str, Any]) -> None:
    check_init_info(info, NETWORKS)


@pytest.mark.parametrize(
    ("info", "code", "field"),
    [
        (_info("10.21.0.1"), "rendezvous_not_allowed", "master_address"),
        (_info("192.168.1.8"), "rendezvous_not_allowed", "master_address"),
        (_info("fd00:2::1"), "rendezvous_not_allowed", "master_address"),
        (_info("::ffff:10.21.0.1"), "rendezvous_not_allowed", "master_address"),
        (_info("trainer.example.com"), "rendezvous_not_allowed", "master_address"),
        (_info("10.20.0.1."), "rendezvous_not_allowed", "master_address"),
        (_info("010.20.0.1"), "rendezvous_not_allowed", "master_address"),
        (_info("10.20.1"), "rendezvous_not_allowed", "master_address"),
        (_info("0.0.0.0"), "rendezvous_not_allowed", "master_address"),
        (_info("::"), "rendezvous_not_allowed", "master_address"),
        (_info(["10.20.0.1"]), "invalid_request", "master_address"),
        (_info("10.20.0.1", master_port=70000), "invalid_request", "master_port"),
        (_info("10.20.0.1", master_port=True), "invalid_request", "master_port"),
        (_info("10.20.0.1", master_port="29500"), "invalid_request", "master_port"),
        ({"master_address": "10.20.0.1"}, "invalid_request", "master_port"),
        ({"master_port": 29500}, "invalid_request", "master_address"),
        (_info("10.20.0.1", peer="10.9.9.9"), "invalid_request", "peer"),
        ({"nccl_unique_id_b64": "AAAA"}, "rendezvous_not_allowed", "nccl_unique_id_b64"),
    ],
)
def test_anything_else_is_refused_naming_the_field(
    info: dict[str, Any], code: str, field: str
) -> None:
    with pytest.raises(RendezvousRefused) as refused:
        check_init_info(info, NETWORKS)
    assert (refused.value.code, refused.value.field) == (code, f"init_info.{field}")


def test_no_trainer_network_refuses_every_push_naming_the_setting() -> None:
    for info in (_info("10.20.3.4"), {}, {"packed": False}):
        with pytest.raises(RendezvousRefused, match="WEIGHTROLL_AGENT_TRAINER_NETWORKS") as e:
            check_init_info(info, ())
        assert e.value.code == "trainer_push_disabled"


@pytest.mark.parametrize("bad", ["10.20.0.1/16", "10.20.0.0/33", "trainers", "10.20.0.0/16;"])
def test_a_setting_that_is_not_a_network_is_an_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="is not an IP network"):
        parse_networks(f"10.0.0.0/8,{bad}")
    with pytest.raises(RendezvousRefused, match="WEIGHTROLL_TRAINER_NETWORKS"):
        networks_from_env({"WEIGHTROLL_TRAINER_NETWORKS": bad})
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--trainer-networks", bad])
    assert exit_.value.code == 2


def test_the_agent_setting_reaches_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_config(parse_args([])).trainer_networks == ()
    monkeypatch.setenv("WEIGHTROLL_AGENT_TRAINER_NETWORKS", "10.20.0.0/16 fd00:1::/64")
    assert build_config(parse_args([])).trainer_networks == (
        ipaddress.ip_network("10.20.0.0/16"),
        ipaddress.ip_network("fd00:1::/64"),
    )
    args = parse_args(["--trainer-networks", "127.0.0.1"])  # the flag wins
    assert build_config(args).trainer_networks == (ipaddress.ip_network("127.0.0.1/32"),)
    assert networks_from_env({}) == ()


def test_pickled_update_payloads_are_refused() -> None:
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    check_update_info(update)
    check_update_info([update, {**update, "ipc_handles_pickled": None}])
    for bad in ({**update, "ipc_handles_pickled": "gASV"}, [update, {"ipc_handles_pickled": "x"}]):
        with pytest.raises(RendezvousRefused) as refused:
            check_update_info(bad)
        assert refused.value.code == "insecure_serialization"
