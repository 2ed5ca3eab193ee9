"""The startup agreement check names the node and both values for every disagreement."""

from __future__ import annotations

from meshtune.train.agreement import differences, find_disagreements


def facts(rank: int, agent: int, node_rank: int, host: str, **changes) -> dict:
    base = {"rank": rank, "local_rank": rank % 2, "host": host, "agent": agent, "node_rank": node_rank,
            "config key learning_rate": "0.0001", "processes per node": 2, "device type": "cpu",
            "torch version": "2.13.0"}
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


def test_one_comparison_lists_each_value_with_its_nodes_the_reference_last():
    """A node's processes count once, a node without a fact is not compared on it, positions name the nodes
    whose value is not the reference node's."""
    nodes = [("node 0 (a)", {"x": 1, "y": "same"}), ("node 0 (a)", {"x": 1}), ("node 1 (b)", {"x": 2, "y": "same"}),
             ("node 2 (c)", {"x": 2, "z": 3})]
    [found] = differences(nodes)
    assert str(found) == "x differs between nodes: node 1 (b), node 2 (c): 2; node 0 (a): 1"
    assert found.key == "x" and found.reference == "1" and found.differing == {2, 3}
    [against_node_1] = differences(nodes, reference=2)
    assert str(against_node_1) == "x differs between nodes: node 0 (a): 1; node 1 (b), node 2 (c): 2"
    assert against_node_1.differing == {0, 1}
    assert differences(nodes[:2]) == []
