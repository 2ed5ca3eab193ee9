"""The startup agreement check: right after rendezvous, before any model loads, every rank shares a few facts
(every config key all nodes must share, library versions, dataset checksum, processes per node, device type, its
node rank) and all ranks stop with the same message if the nodes disagree, naming the key, the nodes and both
values.

Version drift and a stale data copy on one node otherwise show up hours later as an obscure NCCL error or a
silently diverging loss.
"""

from __future__ import annotations

import json
import os
import socket
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from meshtune.checksums import dataset_checksum
from meshtune.config import JOB, MATH, TrainConfig
from meshtune.data.registry import resolve_all
from meshtune.distributed import DistEnv
from meshtune.errors import MeshtuneError
from meshtune.package_clash import installed_version

PACKAGES = ("meshtune", "torch", "transformers", "peft")
PROCESS_KEYS = ("rank", "local_rank", "host", "agent", "node_rank")  # whose facts they are: not compared


class AgreementError(MeshtuneError):
    """Nodes of one job disagree on something that must be identical."""


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    return {name: installed_version(name) or "not installed" for name in names}


def node_rank_of_this_process() -> int:
    """The node rank the user gave (launcher exports it), else torchrun's agent rank."""
    return int(os.environ.get("MESHTUNE_NODE_RANK", os.environ.get("GROUP_RANK", "0")))


def local_facts(cfg: TrainConfig, env: DistEnv) -> dict:
    """What this rank knows; a failure to compute a fact becomes a reported fact, so no rank is left waiting."""
    facts = {"rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
             "agent": int(os.environ.get("GROUP_RANK", "0")), "node_rank": node_rank_of_this_process(),
             **shared_config(cfg), "processes per node": env.local_world_size,
             "device type": env.device.type, **{f"{name} version": v for name, v in package_versions().items()}}
    if env.is_local_main:  # hashing the data once per node is enough
        try:
            specs = resolve_all(cfg)
            facts["dataset checksum"] = dataset_checksum(specs)[:16]
        except (MeshtuneError, OSError) as exc:
            facts["dataset checksum"] = f"unreadable ({exc})"
    return facts


def shared_config(cfg: TrainConfig) -> dict[str, str]:
    """The keys every node must run with the same value (scopes math and job: config.Section), one fact each."""
    values = cfg.model_dump(include=set(TrainConfig.keys_of(MATH, JOB)))
    return {f"config key {name}": json.dumps(value) for name, value in values.items()}


def find_disagreements(all_facts: list[dict]) -> list[str]:
    """Human-readable problems; empty when all nodes agree."""
    problems = []
    nodes_of_agent: dict[int, dict] = {}
    for facts in all_facts:
        nodes_of_agent.setdefault(facts["agent"], facts)
    agents_by_node_rank: dict[int, set[int]] = defaultdict(set)
    for agent, facts in nodes_of_agent.items():
        agents_by_node_rank[facts["node_rank"]].add(agent)
    for node_rank, agents in sorted(agents_by_node_rank.items()):
        if len(agents) > 1:
            hosts = ", ".join(sorted({nodes_of_agent[a]["host"] for a in agents}))
            problems.append(f"NODE_RANK={node_rank} is used by {len(agents)} nodes ({hosts}); give each node its "
                            f"own NODE_RANK from 0 to NNODES-1")
    by_node = [(f"node {facts['node_rank']} ({facts['host']})",
                {key: value for key, value in facts.items() if key not in PROCESS_KEYS}) for facts in all_facts]
    problems += [f"{difference}. {advice(difference.key)}" for difference in differences(by_node)]
    return problems


@dataclass(frozen=True)
class Difference:
    """A fact the nodes do not share: each value with the nodes that hold it, the reference node's value last."""

    key: str
    holders: dict[str, list[str]]  # value -> the labels of the nodes holding it
    reference: str  # the reference node's value
    differing: frozenset[int]  # the positions, among the nodes given, of those whose value is not the reference

    def __str__(self) -> str:
        listing = "; ".join(f"{', '.join(nodes)}: {value}" for value, nodes in self.holders.items())
        return f"{self.key} differs between nodes: {listing}"


def differences(nodes: Sequence[tuple[str, Mapping[str, object]]], reference: int = 0) -> list[Difference]:
    """What the nodes do not share, from each node's label ("node 1 (host-b)") and facts, against the node at
    `reference` (node 0): by key, in the order the facts name them, the values that differ from the reference's
    listed first. Values compare as text. A node without a key is not compared on it (a fact only one process of
    a node computes); entries of one label (a node's processes) count as one node."""
    found = []
    for key in dict.fromkeys(key for _, facts in nodes for key in facts):
        holders: dict[str, list[str]] = {}
        for label, facts in nodes:
            if key in facts and label not in (labels := holders.setdefault(str(facts[key]), [])):
                labels.append(label)
        if len(holders) < 2:
            continue
        own = nodes[reference][1]
        value = str(own[key]) if key in own else next(iter(holders))
        holders[value] = holders.pop(value)
        found.append(Difference(key, holders, value, frozenset(
            i for i, (_, facts) in enumerate(nodes) if key in facts and str(facts[key]) != value)))
    return found


def advice(key: str) -> str:
    if key.startswith("config key"):
        return ("Run the same config and overrides on every node (only the keys of nodes and launch, output paths "
                "and housekeeping may differ).")
    if key == "dataset checksum":
        return ("The data files differ, or the dataset_info.json entries naming them read them otherwise (formatting, "
                "columns, tags): put them on shared storage or copy the same files to every node.")
    if key.endswith("version"):
        return "Install the same versions on every node (same image or lock file)."
    if key == "processes per node":
        return "Set the same NPROC_PER_NODE (nproc_per_node) on every node."
    return "Use the same kind of machine on every node."


def check_agreement(cfg: TrainConfig, env: DistEnv) -> list[tuple[int, str]]:
    """Collective: every rank calls it; all raise the same AgreementError on a mismatch. Returns each rank's node
    rank and host, in rank order."""
    if env.world_size == 1:
        return [(node_rank_of_this_process(), socket.gethostname())]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, local_facts(cfg, env))
    problems = find_disagreements(gathered)
    if problems:
        raise AgreementError("the nodes of this job disagree, stopping before the model loads:\n  - "
                             + "\n  - ".join(problems))
    return [(facts["node_rank"], facts["host"]) for facts in gathered]
