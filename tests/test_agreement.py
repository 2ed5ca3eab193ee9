"""The startup agreement check names the node and both values for every disagreement."""

from __future__ import annotations

from meshtune.train.agreement import find_disagreements


def facts(rank: int, agent: int, node_rank: int, host: str, **changes) -> dict:
    base = {"rank": rank, "local_rank": rank % 2, "host": host, "agent": agent, "node_rank": node_rank,
            "config key learning_rate": "0.0001", "processes per node": 2, "device type": "cpu", "torch version": "2.13.0"}
    if rank % 2 == 0:
        base["dataset checksum"] = "d1"
    base.update(changes)
    return base


def cluster(**node1_changes) -> list[dict]:
    return [facts(0, 0, 0, "node-a"), facts(1, 0, 0, "node-a"),
            facts(2, 1, 1, "node-b", **node1_changes), facts(3, 1, 1, "node-b", **node1_changes)]


def test_agreeing_nodes_pass():
    assert find_disagreements(cluster()) == []


def test_different_config_names_both_nodes_and_values():
    [problem] = find_disagreements(cluster(**{"config key learning_rate": "0.0002"}))
    assert "config key learning_rate differs" in problem
    assert "node 0 (node-a): 0.0001" in problem and "node 1 (node-b): 0.0002" in problem
    assert "same config" in problem


def test_different_dataset_and_versions():
    problems = find_disagreements(cluster(**{"dataset checksum": "d2", "torch version": "2.11.0"}))
    assert any("dataset checksum differs" in p and "node 1 (node-b): d2" in p for p in problems)
    assert any("torch version differs" in p and "2.11.0" in p and "same versions" in p for p in problems)


def test_duplicate_node_rank_is_detected():
    nodes = [facts(0, 0, 1, "node-a"), facts(1, 0, 1, "node-a"), facts(2, 1, 1, "node-b"), facts(3, 1, 1, "node-b")]
    [problem] = find_disagreements(nodes)
    assert "NODE_RANK=1 is used by 2 nodes (node-a, node-b)" in problem
