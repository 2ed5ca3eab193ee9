"""`meshtune doctor` on simulated nodes: `meshtune doctor cfg.yaml` started once per node on 127.0.0.1 with that
node's NODE_RANK, as a user would on each machine. A healthy pair passes; each fault is named with its node."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from conftest import base_config, kill_tree, write_config
from test_launch import clean_env

TIMEOUT = 60  # seconds a test's nodes may take; the doctor's own --timeout is far below


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_nodes(config, nodes: list[dict], doctor_timeout: float = 15, extra_args=()) -> list[tuple[int, str]]:
    """Each dict: the node's environment on top of the shared one (NODE_RANK and anything it changes), and
    `args`: key=value overrides for that node. Node 0 first. Returns (exit code, output) per node."""
    port = free_port()
    processes = []
    try:
        for node in nodes:
            env = clean_env(**{"NNODES": str(len(nodes)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "NPROC_PER_NODE": "1", **{k: v for k, v in node.items() if k != "args"}})
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "meshtune", "doctor", str(config), *node.get("args", []),
                 "--timeout", str(doctor_timeout), *extra_args],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            time.sleep(0.5)
        results = []
        for process in processes:
            output, _ = process.communicate(timeout=TIMEOUT)
            results.append((process.returncode, output))
        return results
    finally:
        for process in processes:
            kill_tree(process.pid)


@pytest.fixture
def config(tmp_path, tiny_model_dir, tiny_dataset):
    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "output")
    del values["nproc_per_node"]
    return write_config(tmp_path, **values)


def row(output: str, check: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(check))


def test_a_healthy_pair_of_nodes_passes_and_node_0_prints_one_table(config, tmp_path):
    started = time.monotonic()
    (code0, out0), (code1, out1) = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1"}],
                                            extra_args=["--json", str(tmp_path / "doctor.json")])
    assert time.monotonic() - started < 30
    assert (code0, code1) == (0, 0), out0 + out1
    assert "✔ every node is ready" in out0 and "node 0 (" in out0 and "node 1 (" in out0
    for check in ("node joined, NODE_RANK", "NNODES, MASTER_ADDR/PORT, processes", "config (keys all nodes share)",
                  "torch, transformers, peft, torchao, meshtune", "model files", "dataset files",
                  "output_dir: writable, shared, space", "clock, against node 0", "interface to MASTER_ADDR"):
        assert "✘" not in row(out0, check), row(out0, check)
    assert "lo (127.0.0.1)" in row(out0, "interface to MASTER_ADDR")
    assert "node 1: node 0 printed the table; every check passed here" in out1
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert not report["failed"] and [c["node_rank"] for c in report["columns"]] == [0, 1]
    assert not list((tmp_path / "output").glob(".meshtune-doctor-*"))  # node 0's token removed


def test_each_fault_is_named_with_its_node(config, tmp_path, tiny_dataset):
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(tiny_dataset.read_text().replace("the", "a"))
    (code0, out0), (code1, out1) = run_nodes(config, [
        {"NODE_RANK": "0"},
        {"NODE_RANK": "1", "MESHTUNE_DOCTOR_FAKE_VERSIONS": "transformers=0.0.1",
         "args": [f"dataset={other_data}", f"output_dir={tmp_path / 'local-output'}"]}])
    assert code0 == 1 and code1 == 1, out0
    assert "✘" in row(out0, "torch, transformers, peft, torchao, meshtune")
    assert "transformers 0.0.1 (node 0:" in out0
    assert "✘ sha256" in row(out0, "dataset files")
    assert "✘ not the storage node 0 writes to" in row(out0, "output_dir: writable, shared, space")
    assert "✘ differs: dataset" in row(out0, "config (keys all nodes share)")
    assert row(out0, "model files").count("✔") == 2
    assert "✘ at least one check failed" in out0
    assert "node 1: node 0 printed the table; 4 check(s) need attention here" in out1
    assert "fix: install the same versions on every node" in out1


def test_duplicate_node_rank_and_nnodes_mismatch(config):
    results = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1"}, {"NODE_RANK": "1", "NNODES": "4"}])
    (code0, out0), _, (code2, out2) = results
    assert code0 == 1 and code2 == 1
    line = row(out0, "node joined, NODE_RANK")
    assert line.count("NODE_RANK 1 also on") == 2 and "missing node rank(s) 2" in line
    assert "give each node its own NODE_RANK" in out0
    assert "✘ 4 nodes" in row(out0, "NNODES, MASTER_ADDR/PORT, processes") and "node 0 has nnodes=3" in out0


def test_a_wrong_port_or_a_missing_master_fails_within_the_timeout_naming_the_node(config):
    started = time.monotonic()
    port = free_port()
    (code0, out0), (code1, out1) = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1",
                                                                           "MASTER_PORT": str(port)}],
                                             doctor_timeout=5)
    assert time.monotonic() - started < 40
    assert code0 == 1 and "missing node rank(s) 1" in row(out0, "node joined, NODE_RANK")
    assert "did not join within 5 s" in out0
    assert code1 == 1 and f"node 1 could not reach node 0 at 127.0.0.1:{port} within 5 s" in out1
    assert "a MASTER_PORT that differs between nodes" in out1


def test_an_elastic_job_missing_nodes_above_its_minimum_is_a_note_not_a_failure():
    from meshtune.launch.doctor import FAIL, WARN, joined_row

    facts = [{"node_rank": 0, "host": "a"}, {"node_rank": 1, "host": "b"}]
    assert joined_row(facts, 2, 4, 30).cells[0] == (WARN, "missing node rank(s) 2, 3")  # nnodes: 2:4
    assert joined_row(facts, 3, 4, 30).cells[0][0] == FAIL  # nnodes: 3:4
    assert not joined_row(facts, 2, 2, 30).failed
