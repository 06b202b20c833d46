"""Push a checkpoint to one or more replicas through their weightroll agents (``weightroll_gloo``).

Every replica runs vLLM with ``--weight-transfer-config '{"backend": "weightroll_gloo"}'`` and
the weightroll agent next to it. This script is the trainer: it opens one Gloo transfer group
per replica, sends every tensor of the checkpoint, and prints one JSON result per replica
(``committed`` / ``failed`` with the agent's reason / ``unreachable``). Exit status 0 only if
every replica committed.

    python examples/05-trainer/push.py --agent http://10.0.1.5:8470 --agent http://10.0.1.6:8470 \\
        --token-file token --checkpoint /models/step-7 --version step-7 --master-address 10.0.3.7
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engine_agent.trainer import AgentSyncClient, CheckpointSource, push_fleet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", action="append", required=True, help="a replica's agent URL")
    parser.add_argument(
        "--token-file",
        required=True,
        help="the trainers' token (agent --trainer-token-file)",
    )
    parser.add_argument("--ca-file", help="https:// agents: the CA their certificates chain to")
    parser.add_argument(
        "--server-name", help="the name on the agents' certificates, e.g. weightroll-agent.ml.svc"
    )
    parser.add_argument("--checkpoint", required=True, help="safetensors checkpoint directory")
    parser.add_argument("--version", required=True, help="the weight version to commit")
    parser.add_argument(
        "--master-address",
        default="127.0.0.1",
        help="this trainer's address as the replicas' workers reach it",
    )
    args = parser.parse_args()
    replicas = [
        AgentSyncClient(
            url, token_file=args.token_file, ca_file=args.ca_file, server_name=args.server_name
        )
        for url in args.agent
    ]
    results = push_fleet(
        replicas,
        CheckpointSource(args.checkpoint),
        weight_version=args.version,
        master_address=args.master_address,
    )
    json.dump([dataclasses.asdict(result) for result in results], sys.stdout, indent=2)
    print()
    return 0 if all(result.outcome == "committed" for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
