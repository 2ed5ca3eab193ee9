"""bench/shaped_link.py on two network namespaces behind a 1 Gbit/s token bucket: a small ddp job's bytes a step,
counted by the interfaces themselves, are what meshtune.doctor.traffic says ddp moves. Needs root and iproute2;
skipped, saying so, elsewhere."""

from __future__ import annotations

import json

import pytest

import shaped_link
from network_namespaces import unavailable

pytestmark = pytest.mark.slow
TCP_OVERHEAD = 1.08  # Ethernet + IP + TCP headers on 1500-byte frames, the peer's acknowledgements, the loss's sum


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    why = unavailable()
    if why:
        pytest.skip(f"bench/shaped_link.py: {why}")
    work = tmp_path_factory.mktemp("shaped")
    code = shaped_link.main(["--size", "tiny", "--tokens-per-row", "64", "--variant", "ddp:parallel=ddp",
                             "--steps", "3", "--rate", "1gbit", "--timeout", "240", "--work", str(work / "work"),
                             "--tag", "slt", "--out", str(work / "link")])
    assert code == 0
    return json.loads((work / "link.json").read_text())


def predicted_bytes_a_node(report: dict) -> float:
    """What each node sends a step by the doctor's formula: ddp all-reduces the gradients, 2(n-1)/n of them."""
    from meshtune.config import build_config
    from meshtune.doctor.traffic import model_facts, step_collectives

    cfg = build_config({**report["base_config"], **report["variants"]["ddp"]})
    (reduce,) = step_collectives(cfg, "ddp", model_facts(cfg), False, True)
    nodes = report["nodes"]
    return reduce.bytes * 2 * (nodes - 1) / nodes


def test_a_ddp_step_moves_the_gradients_all_reduce_across_the_shaped_link(report):
    (row,) = report["rows"]
    expected = predicted_bytes_a_node(report)
    assert expected <= row["tx_per_node"]["median"] <= expected * TCP_OVERHEAD, (row, expected)
    steps = report["runs"]["ddp"]["shaped"][0]["steps"]
    assert [s["step"] for s in steps] == [2, 3]  # the first step (and the start-up before it) is not counted
    # Every step alike, both ways: one all-reduce each. A step's bytes are counted between two samples taken when
    # rank 0's record appears; a sampler woken late on a loaded machine moves the next step's first bytes into the
    # step before, so each node's steps together carry exactly their all-reduces, and each step most of one.
    for key in ("tx_per_node", "rx_per_node"):
        for node in range(report["nodes"]):
            sent = [step[key][node] for step in steps]
            assert len(sent) * expected <= sum(sent) <= len(sent) * expected * TCP_OVERHEAD, (key, node, steps)
            assert all(0.5 * expected <= one <= 1.5 * expected * TCP_OVERHEAD for one in sent), (key, node, steps)


def test_the_namespaces_are_gone_after_the_job(report):
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    assert report["namespaces"] and report["namespaces"][0].startswith("slt")
    assert not set(report["namespaces"]) & set(listed), listed
