"""`meshtune doctor` on simulated nodes: `meshtune doctor cfg.yaml` started once per node on 127.0.0.1 with that
node's NODE_RANK, as a user would on each machine. A healthy pair passes; each fault is named with its node. With
--bandwidth the pair measures its link; `meshtune train` runs the same checks before torchrun (preflight)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import base_config, kill_tree, read_metrics, write_config
from ranks import free_port
from test_launch import clean_env

TIMEOUT = 60  # seconds a test's nodes may take; the doctor's own --timeout is far below


def run_nodes(config, nodes: list[dict], doctor_timeout: float = 15, extra_args=(), command=("doctor",),
              port: int | None = None) -> list[tuple[int, str]]:
    """Each dict: the node's environment on top of the shared one (NODE_RANK and anything it changes), and
    `args`: key=value overrides for that node. Node 0 first. Returns (exit code, output) per node. `command`:
    `meshtune train` runs its preflight instead. The nodes start together, as they would on their machines: the
    others wait for node 0's port themselves (up to their timeout), and node 0's clock starts at once."""
    port = port or free_port()
    processes = []
    doctor_args = ["--timeout", str(doctor_timeout), *extra_args] if command == ("doctor",) else list(extra_args)
    try:
        for node in nodes:
            env = clean_env(**{"NNODES": str(len(nodes)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1",
                               **{k: v for k, v in node.items() if k != "args"}})
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "meshtune", *command, str(config), *node.get("args", []), *doctor_args],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        results = []
        # a training job (two launchers, torchrun, workers importing torch) takes longer than the doctor on 2 busy cores
        timeout = TIMEOUT if command == ("doctor",) else 3 * TIMEOUT
        for process in processes:
            output, _ = process.communicate(timeout=timeout)
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


@pytest.mark.slow
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


class WrongPortNode:
    """`meshtune doctor` as node 1 alone, on a port where nothing listens, with the doctor's default --timeout
    (30 s): what it prints and how long it ran. It spends those seconds waiting, so it runs beside the tests
    between its start (by the first test after the healthy pair, whose time is measured) and its own test."""

    def __init__(self, directory: Path, config: Path):
        self.log, self.config, self.process = directory / "wrong-port.log", config, None
        self.port, self.started, self.ended, self.clock = 0, 0.0, None, None

    def start(self) -> None:
        if self.process is None:
            self.port, self.started = free_port(), time.monotonic()  # nothing listens there
            with self.log.open("w") as out:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "meshtune", "doctor", str(self.config)], stdout=out,
                    stderr=subprocess.STDOUT, env=clean_env(NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1",
                                                            MASTER_PORT=str(self.port), NPROC_PER_NODE="1",
                                                            OMP_NUM_THREADS="1"))
            self.clock = threading.Thread(target=self._clock, daemon=True)  # notes the exit as it happens
            self.clock.start()

    def _clock(self) -> None:
        self.process.wait()
        self.ended = time.monotonic()

    def result(self) -> tuple[int, str, float]:
        """(exit code, output, seconds from its start to its exit)."""
        self.start()
        self.clock.join(timeout=120)
        assert self.ended is not None, f"node 1 still ran 120 s after its start:\n{self.log.read_text()[-3000:]}"
        return self.process.returncode, self.log.read_text(), self.ended - self.started


@pytest.fixture(scope="module")
def wrong_port_node(tmp_path_factory, tiny_model_dir, tiny_dataset):
    directory = tmp_path_factory.mktemp("wrong-port")
    values = base_config(tiny_model_dir, tiny_dataset, directory / "output")
    del values["nproc_per_node"]
    node = WrongPortNode(directory, write_config(directory, **values))
    yield node
    if node.process is not None:
        kill_tree(node.process.pid)


@pytest.mark.slow
def test_each_fault_is_named_with_its_node(config, tmp_path, tiny_dataset, wrong_port_node):
    wrong_port_node.start()  # for test_a_wrong_port_is_named_on_its_node_soon_after_the_default_timeout
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


@pytest.mark.slow
def test_duplicate_node_rank_and_nnodes_mismatch(config):
    results = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1"}, {"NODE_RANK": "1", "NNODES": "4"}])
    (code0, out0), _, (code2, out2) = results
    assert code0 == 1 and code2 == 1
    line = row(out0, "node joined, NODE_RANK")
    assert line.count("NODE_RANK 1 also on") == 2 and "missing node rank(s) 2" in line
    assert "give each node its own NODE_RANK" in out0
    assert "✘ 4 nodes" in row(out0, "NNODES, MASTER_ADDR/PORT, processes") and "node 0 has nnodes=3" in out0


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_wrong_port_is_named_on_its_node_soon_after_the_default_timeout(wrong_port_node):
    """The node with the wrong MASTER_PORT alone, the doctor's default --timeout (30 s): its start-up (imports on
    2 busy cores) plus the timeout, not TCPStore's second attempt after a backoff (about 70 s in all). Started
    by an earlier test (WrongPortNode)."""
    code, out, took = wrong_port_node.result()
    port = wrong_port_node.port
    assert code == 1 and f"node 1 could not reach node 0 at 127.0.0.1:{port} within 30 s" in out, out
    assert "a MASTER_PORT that differs between nodes" in out and "TCPStore" not in out, out
    assert 30 <= took < 60, (took, out)


def test_an_elastic_job_missing_nodes_above_its_minimum_is_a_note_not_a_failure():
    from meshtune.doctor.checks import FAIL, WARN, joined_row

    facts = [{"node_rank": 0, "host": "a"}, {"node_rank": 1, "host": "b"}]
    assert joined_row(facts, 2, 4, 30).cells[0] == (WARN, "missing node rank(s) 2, 3")  # nnodes: 2:4
    assert joined_row(facts, 3, 4, 30).cells[0][0] == FAIL  # nnodes: 3:4
    assert not joined_row(facts, 2, 2, 30).failed


def test_the_doctor_names_differing_keys_in_the_agreement_checks_words():
    """The config and software rows compare through train/agreement.differences: the same sentence training's
    agreement check prints, each node's cell naming what differs there."""
    from meshtune.doctor.checks import FAIL, OK, config_row, software_row
    from meshtune.train.agreement import find_disagreements

    def node(rank, host, lr, torch_version):
        return {"node_rank": rank, "host": host, "config": {"config key learning_rate": lr, "config key seed": "1"},
                "software": {"torch": torch_version, "meshtune": "1.0"}}

    facts = [node(0, "a", "0.0001", "2.13"), node(1, "b", "0.0002", "2.13"), node(2, "c", "0.0002", "2.11")]
    row = config_row(facts, facts[0])
    assert [row.cells[p] for p in range(3)] == [(OK, "same as node 0"), (FAIL, "differs: learning_rate"),
                                                 (FAIL, "differs: learning_rate")]
    sentence = "config key learning_rate differs between nodes: node 1 (b), node 2 (c): 0.0002; node 0 (a): 0.0001"
    assert row.fixes == [f"{sentence}. Run the same config and overrides on every node"]
    ranks = [{"rank": f["node_rank"], "local_rank": 0, "agent": f["node_rank"], **f, **f["config"]} for f in facts]
    for facts_of_rank in ranks:
        del facts_of_rank["config"], facts_of_rank["software"]
    [problem] = find_disagreements(ranks)
    assert problem.startswith(sentence + ". Run the same config")
    software = software_row(facts, facts[0])
    assert software.cells[2] == (FAIL, "torch 2.11 (node 0: 2.13)") and software.cells[1][0] == OK



@pytest.mark.slow
def test_bandwidth_measures_the_link_and_judges_it_against_what_the_config_moves(config, tmp_path):
    started = time.monotonic()
    (code0, out0), (code1, out1) = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1"}],
                                            extra_args=["--bandwidth", "--json", str(tmp_path / "doctor.json")])
    assert time.monotonic() - started < 60
    assert (code0, code1) == (0, 0), out0 + out1
    for check in ("all-reduce bus bandwidth", "latency", "slowest pair", "verdict for ddp"):
        assert row(out0, check).count("✔") == 2, row(out0, check)
    assert "GB/s at 16 MiB, gloo" in row(out0, "all-reduce bus bandwidth")
    assert "(1 KiB all-reduce)" in row(out0, "latency") and "to node 1: " in row(out0, "slowest pair")
    assert "comm a step (no GPU)" in row(out0, "verdict for ddp")
    assert "all-reduce over 2 nodes, one process a node (gloo, cpu):" in out0 and "node 0 <-> node 1" in out0
    assert "per optimizer step: lora fine-tuning under ddp moves all-reduce of the gradients" in out0
    measured = json.loads((tmp_path / "doctor.json").read_text())["bandwidth"]
    sizes = measured["result"]["all_reduce"]
    assert [r["bytes"] for r in sizes] == [2**10, 2**20, 16 * 2**20]
    for r in sizes:  # nccl-tests' definitions: algbw = bytes / time, busbw = algbw x 2(n-1)/n (n = 2: equal)
        assert r["seconds"] > 0 and r["algbw"] == pytest.approx(r["bytes"] / r["seconds"]) and r["busbw"] == r["algbw"]
    assert [(p["a"], p["b"]) for p in measured["result"]["pairs"]] == [(0, 1)] and measured["result"]["pairs"][0][
        "bandwidth"] > 0
    traffic = measured["traffic"]
    assert traffic["parallel"] == "ddp" and traffic["comm_s"] > 0 and traffic["ratio"] is None
    assert [c["kind"] for c in traffic["collectives"]] == ["all-reduce"]  # LoRA under ddp: the adapters' gradients
    assert "node 1: node 0 printed the table; every check passed here" in out1


def test_the_launch_row_reads_as_a_sentence_on_one_node_and_on_several():
    from meshtune.doctor.checks import OK, launch_row

    one = {"nnodes": 1, "master_addr": "127.0.0.1", "master_port": None, "nproc_per_node": 1}
    assert launch_row([one], one).cells[0] == (OK, "1 node, 127.0.0.1 (no port: one node), 1/node")
    two = [{**one, "nnodes": 2, "master_port": 29500, "nproc_per_node": 8}] * 2
    assert launch_row(two, two[0]).cells[1] == (OK, "2 nodes, 127.0.0.1:29500, 8/node")


@pytest.mark.slow
def test_on_cpu_nodes_with_link_gbps_bandwidth_judges_the_mode_the_plan_picks_by_the_link(config, tmp_path):
    """Full fine-tuning with link_gbps on CPU nodes: node 0 measures a process's fp32 rate on its share of the
    cores, and the verdict names the mode `parallel: auto` picks by the link from it, as the run's plan would."""
    args = ["finetuning_type=full", "parallel=auto", "link_gbps=0.001"]
    (code0, out0), (code1, _) = run_nodes(config, [{"NODE_RANK": "0", "args": args}, {"NODE_RANK": "1", "args": args}],
                                          extra_args=["--bandwidth", "--json", str(tmp_path / "doctor.json")])
    assert (code0, code1) == (0, 0), out0
    measured = json.loads((tmp_path / "doctor.json").read_text())["bandwidth"]
    assert 1e8 < measured["result"]["peak_flops"] < 1e13
    assert "under ddp inside pipeline_parallel 2 (auto by link_gbps 0.001) moves send of the activations" in measured[
        "traffic"]["text"], measured["traffic"]["text"]
    assert "comm a step (no GPU)" in row(out0, "verdict for"), measured["traffic"]["text"]


def test_pairs_rounds_meet_every_pair_once_and_busbw_follows_nccl_tests():
    from meshtune.doctor.bandwidth import bus_bandwidth, pair_rounds

    for n in range(2, 9):
        rounds = pair_rounds(n)
        met = [pair for pairs in rounds for pair in pairs]
        assert sorted(met) == [(a, b) for a in range(n) for b in range(a + 1, n)], n
        assert all(len({r for pair in pairs for r in pair}) == 2 * len(pairs) for pairs in rounds)  # disjoint
    assert len(pair_rounds(40)) == 15
    assert bus_bandwidth(8e9, 2.0, 8) == (4e9, 4e9 * 2 * 7 / 8)


def test_the_traffic_of_a_step_follows_the_parallel_mode():
    from meshtune.config import build_config
    from meshtune.doctor.traffic import ModelFacts, collective_seconds, step_collectives, verdict
    from meshtune.plan import ModelSize

    model = ModelFacts(ModelSize(7_000_000_000, 200_000_000, 30), 7_000_000_000, 6_500_000_000, 30, 4096)

    def moved(parallel: str, **keys) -> list[tuple[str, float, int]]:
        cfg = build_config(dict(model_name_or_path="m", dataset=["d"], finetuning_type="full",
                                gradient_accumulation_steps=4, parallel=parallel, **keys))
        return [(c.kind, c.bytes, c.times) for c in step_collectives(cfg, parallel, model, True, True)]

    weights, gradients = 14e9, 28e9  # bf16 weights, fp32 gradients
    assert moved("ddp") == moved("hsdp") == [("all-reduce", gradients, 1)]  # hsdp: only the replicas' all-reduce
    assert moved("zero2") == [("all-gather", weights, 1), ("reduce-scatter", gradients, 1)]  # whole across micro
    # zero3 gathers again for backward all but the last unit (2 blocks of 4 a unit: 0.4B) and the head (0.5B)
    again = weights * (1 - 0.9e9 / 7e9)
    assert moved("zero3") == [("all-gather", weights, 4), ("all-gather", pytest.approx(again), 4),
                              ("reduce-scatter", gradients, 1)]
    assert moved("hsdp", grad_reduce_dtype="bf16") == [("all-reduce", gradients / 2, 1)]
    # over 2 nodes at 10 GB/s: an all-reduce sends 2(n-1)/n of its bytes, an all-gather (n-1)/n
    zero3 = step_collectives(build_config(dict(model_name_or_path="m", dataset=["d"], finetuning_type="full",
                                               parallel="zero3")), "zero3", model, True, True)
    assert collective_seconds(zero3, 10e9, 2) == pytest.approx((weights + again + gradients) * 0.5 / 10e9)
    cfg = build_config(dict(model_name_or_path="m", dataset=["d"], finetuning_type="full", parallel="zero3",
                            cutoff_len=4096, per_device_train_batch_size=2, gradient_accumulation_steps=4))
    slow = verdict(cfg, 2, 8, True, 80e9, 1.2e9, 400e12, model)
    assert slow["slow"] and slow["ratio"] > 1 and "parallel: hsdp shards inside each node" in slow["advice"]
    assert not verdict(cfg, 2, 8, True, 80e9, 400e9, 400e12, model)["slow"]
    assert "link_gbps" not in slow["advice"]  # parallel named: auto chooses nothing
    auto = build_config(dict(model_name_or_path="m", dataset=["d"], finetuning_type="full", cutoff_len=4096))
    assert "link_gbps: 10.7 (this link) lets parallel: auto choose" in verdict(auto, 2, 8, True, 80e9, 1.2e9, 400e12,
                                                                             model)["advice"]
    lora = build_config(dict(model_name_or_path="m", dataset=["d"], finetuning_type="lora"))
    adapters = ModelFacts(model.size, 20_000_000, model.dense, 30, 4096)
    assert verdict(lora, 2, 8, True, 80e9, 1.2e9, None, adapters)["parallel"] == "ddp"  # auto: LoRA runs ddp
    assert step_collectives(lora, "ddp", adapters, True, True)[0].bytes == 80e6


def test_each_node_sends_a_rings_share_of_the_collective_over_its_processes():
    """A ring over every process enters and leaves each node once: ddp over 2 nodes x 8 sends 2(16-1)/16 of the
    gradients out of each node, hsdp's all-reduce between the 2 replicas 2(2-1)/2. What bench/shaped_link.py counts
    on the interfaces (docs/benchmarks/network.md): ddp 2 x 2 sends 1.5 S a node; on gloo zero2's reduce-scatter
    moves as much as an all-reduce; zero3_reshard_to_node gathers across the nodes only for forward."""
    from meshtune.config import build_config
    from meshtune.crossing import ModelFacts, sent_by_each_node
    from meshtune.doctor.traffic import step_collectives
    from meshtune.plan import ModelSize

    model = ModelFacts(ModelSize(1_000_000, 100_000, 8), 1_000_000, 900_000, 8, 512)
    S = 4e6  # fp32 gradients

    def sent(parallel: str, per_node: int, gloo: bool = False, **keys) -> float:
        cfg = build_config(dict(model_name_or_path="m", dataset=["d"], finetuning_type="full", parallel=parallel,
                                **keys))
        return sent_by_each_node(step_collectives(cfg, parallel, model, False, True, 2 * per_node, None, per_node,
                                                  gloo), 2)

    assert sent("ddp", 8) == pytest.approx(2 * 15 / 16 * S)
    assert sent("ddp", 2) == pytest.approx(1.5 * S) and sent("ddp", 1) == pytest.approx(S)
    assert sent("hsdp", 8) == pytest.approx(S)
    assert sent("zero2", 2) == pytest.approx(0.75 * S + 0.75 * S)
    assert sent("zero2", 2, gloo=True) == pytest.approx(0.75 * S + 1.5 * S)
    kept = (4 * 100_000 + 100_000) / 1_000_000  # kept from forward to backward: the last unit (4 blocks), the head
    assert sent("zero3", 2) == pytest.approx((0.75 + 0.75 * (1 - kept)) * S + 0.75 * S)
    assert sent("zero3", 2, zero3_reshard_to_node=True) == pytest.approx(0.75 * S + 0.75 * S)


def train_config(tmp_path, tiny_model_dir, tiny_dataset, **extra):
    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "output", max_steps=2, save_final=False,
                         tokenized_path=str(tmp_path / "tokenized"), **extra)
    del values["nproc_per_node"]
    return write_config(tmp_path, **values)


@pytest.mark.slow
def test_preflight_stops_the_launch_before_torchrun_naming_the_node_whose_data_differs(tmp_path, tiny_model_dir,
                                                                                     tiny_dataset):
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(tiny_dataset.read_text().replace("the", "a"))
    config = train_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=30)
    (code0, out0), (code1, out1) = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1",
                                                                           "args": [f"dataset={other_data}"]}],
                                             command=("train",))
    assert (code0, code1) == (1, 1), out0 + out1
    assert "✘ sha256" in row(out0, "dataset files") and "✘ differs: dataset" in row(out0, "config (keys all")
    assert 'config key dataset differs between nodes: node 1 (' in out0 and str(other_data) in out0
    last = out0.strip().splitlines()[-1]
    assert last.startswith("meshtune: error: preflight: 2 check(s) failed across the nodes (config (keys all nodes "
                           "share), dataset files)") and "set preflight: false" in last, last
    assert "node 1: node 0 printed the table; 2 check(s) need attention here" in out1
    assert out1.strip().splitlines()[-1].startswith("meshtune: error: preflight: 2 check(s) failed")
    assert "rendezvous" not in out0 + out1 and not (tmp_path / "output" / "run_plan.json").exists()


@pytest.mark.slow
def test_preflight_names_a_node_that_never_joins_within_rdzv_timeout(tmp_path, tiny_model_dir, tiny_dataset):
    config = train_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=6)
    started = time.monotonic()
    [(code0, out0)] = run_nodes(config, [{"NODE_RANK": "0", "NNODES": "2"}], command=("train",))
    assert code0 == 1 and time.monotonic() - started < 45, out0
    assert "preflight: 1 of 2 nodes joined (node ranks 0); waiting for node ranks 1" in out0
    assert "missing node rank(s) 1" in row(out0, "node joined, NODE_RANK")
    last = out0.strip().splitlines()[-1]
    assert "preflight: node rank(s) 1 never joined within rdzv_timeout=6 s" in last, last


@pytest.mark.slow
def test_a_relaunched_node_0_and_a_node_joining_a_running_job_skip_the_preflight_and_train(tmp_path, tiny_model_dir,
                                                                                           tiny_dataset):
    """Node 0 relaunched into its running job finds its own output_dir lock (same run id): it skips the preflight.
    Node 1, started next, finds node 0's rendezvous store on the port instead of a doctor: it skips too, and the
    job trains. (A healthy preflight's one line: test_scheduler_files' PBS job.)"""
    from meshtune.launch.nodes import _derived_run_id

    config = train_config(tmp_path, tiny_model_dir, tiny_dataset, rdzv_timeout=60)
    output, port = tmp_path / "output", free_port()
    output.mkdir()
    lock = output / ".meshtune-lock"
    lock.write_text(json.dumps({
        "run_id": _derived_run_id("127.0.0.1", port, str(output)), "host": "another-host", "pid": 12345,
        "started": time.time() - 600}))  # left by node 0's earlier launcher, killed on another host
    os.utime(lock, (time.time() - 40, time.time() - 40))  # its last heartbeat: gone, as a stopped one
    (code0, out0), (code1, out1) = run_nodes(config, [{"NODE_RANK": "0"}, {"NODE_RANK": "1"}], command=("train",),
                                             port=port)
    assert (code0, code1) == (0, 0), out0[-3000:] + out1[-3000:]
    assert "preflight: skipped: node 0 rejoins its running job" in out0
    assert f"preflight: skipped: 127.0.0.1:{port} answers, but not as node 0's doctor" in out1
    assert [r["step"] for r in read_metrics(output)] == [1, 2]


def test_checkpoint_space_counts_the_saves_of_each_save_strategy(tmp_path):
    from types import SimpleNamespace

    from meshtune.doctor.checks import checkpoint_bytes

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2000)  # 1,000 bf16 parameters
    cfg = dict(model_name_or_path=str(tmp_path), finetuning_type="full", save_total_limit=None, max_steps=100,
               save_steps=25, num_train_epochs=3.0, master_weights="fp32")
    per_save = checkpoint_bytes(SimpleNamespace(**cfg, save_strategy="steps")) // 4
    assert per_save == 12_000  # fp32 weights and two moments of 1,000 parameters
    assert checkpoint_bytes(SimpleNamespace(**{**cfg, "master_weights": "bf16"}, save_strategy="steps")) == 4 * 6_000
    assert checkpoint_bytes(SimpleNamespace(**cfg, save_strategy="epoch")) == 3 * per_save
    assert checkpoint_bytes(SimpleNamespace(**cfg, save_strategy="no")) == 0


def test_the_launchers_node_settings_have_every_member_the_doctor_reads():
    """The doctor names the launcher's NodeSettings by its shape (LaunchSettings), since the launcher imports the
    doctor: a member renamed on one side only would show first on a multi-node launch."""
    from meshtune.doctor.launch_settings import LaunchSettings
    from meshtune.launch.nodes import NodeSettings

    members = [name for name, value in vars(LaunchSettings).items() if isinstance(value, property)]
    settings = NodeSettings(nnodes="1:2", node_rank=1, master_addr="node01", master_port=29500, nproc_per_node=8,
                            run_id="job", source={})
    assert {name: getattr(settings, name) for name in members} == {
        "nnodes": "1:2", "node_rank": 1, "master_addr": "node01", "master_port": 29500, "nproc_per_node": 8,
        "run_id": "job", "min_nodes": 1, "max_nodes": 2}
