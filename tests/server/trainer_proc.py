"""A real trainer in its own process: pushes a checkpoint over ``weightroll_gloo`` via agents.

Used by ``tests/server/test_trainer*.py``. Prints one JSON list of per-replica results on stdout.
``--shape`` bends the push into the gap replays: ``half`` (the first half of the tensors, then
finish), ``no-kv`` (everything but layer 0's k_proj/v_proj), ``duplicate`` (layer 0's q_proj
twice in one update), ``full`` (everything). ``--hold-file`` makes the trainer wait, after
start, until that file disappears (so a test can act mid-push).

The tests fork each push from a fork server that imported this module once
(``trainer_scenario.run_trainer``): every push still runs in a process of its own, with no state
left from earlier pushes, but without the ~9 s (idle 2-core machine) of importing torch and vLLM
again each time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from engine_agent.trainer import AgentSyncClient, CheckpointSource, push_fleet


class Shaped(WeightSource):
    def __init__(self, base: CheckpointSource, shape: str) -> None:
        self.base = base
        names = [m.name for m in base.metadata()]
        if shape == "half":
            keep = names[: len(names) // 2]
        elif shape == "no-kv":
            keep = [
                n
                for n in names
                if not ("layers.0." in n and n.endswith(("k_proj.weight", "v_proj.weight")))
            ]
        else:
            keep = names
        self.keep = keep
        self.twice = (
            next(n for n in names if n.endswith("layers.0.self_attn.q_proj.weight"))
            if shape == "duplicate"
            else None
        )

    def _order(self) -> list[str]:
        return [*self.keep, self.twice] if self.twice else self.keep

    def metadata(self) -> list[ParamMeta]:
        by_name = {m.name: m for m in self.base.metadata()}
        return [by_name[n] for n in self._order()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = dict(self.base)
        for name in self._order():
            yield name, tensors[name]


def push(argv: list[str]) -> list[dict[str, object]]:
    """One push as the command line ``argv`` describes it; the per-replica results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent", action="append", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--shape", default="full", choices=["full", "half", "no-kv", "duplicate"])
    parser.add_argument("--hold-file")
    args = parser.parse_args(argv)
    source = Shaped(CheckpointSource(args.checkpoint), args.shape)
    clients = [AgentSyncClient(url, token_file=args.token_file, timeout=120) for url in args.agent]
    if args.hold_file:
        for client in clients:  # wrap start: wait after it returned
            start = client.start_weight_update

            def held(start=start) -> None:  # type: ignore[no-untyped-def]
                start()
                while Path(args.hold_file).exists():
                    time.sleep(0.1)

            client.start_weight_update = held  # type: ignore[method-assign]
    results = push_fleet(clients, source, weight_version=args.version)
    return [dataclasses.asdict(r) for r in results]


def push_in_child(argv: list[str], answer: Connection) -> None:
    """The target of a process forked from the tier's trainer fork server: one push, its
    results sent back (as JSON, as the command line prints them)."""
    answer.send(json.dumps(push(argv)))
    answer.close()


def main() -> int:
    json.dump(push(sys.argv[1:]), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
