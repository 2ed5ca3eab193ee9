"""Nodes killed and relaunched again and again, some right in torchrun's rendezvous: the job never stalls and ends
as the uninterrupted run did.

After every completed c10d round, torch's agents post their workers' share in the round's store and wait for one
another's (`role_info`; agent 0 posts the workers' MASTER_ADDR). A node killed between the round's completion and
its post left the others in that wait, bounded only by the store's read timeout (meshtune's rdzv_timeout, 300 s by
default): node 0's torchrun died after it with a DistStoreError, and the relaunched node waited behind it. Here an
agent of torch's own rendezvous handler joins node 0's round and exits at once, as a node killed just then.

Two nodes of one process each on 127.0.0.1, as tests/test_faults.py runs them; and, without processes, a node
whose node 0 is killed during the preflight's checks. The soak (bench/kill_relaunch_soak.py) runs beside the first
test's job (a side job: its stall bound allows for it), and its test takes the result, or runs it itself when run
alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import kill_tree
from ranks import free_port
from test_faults import JOB_TIMEOUT, Cluster, SideJobs, final_hash, job_config, losses, shared_uninterrupted_run

REPO = Path(__file__).resolve().parent.parent

# an agent that completes a rendezvous round with node 0 and dies before it posts its workers' share
DYING_AGENT = """
import os, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id=sys.argv[2], min_nodes=2, max_nodes=2,
                              is_host=False, read_timeout=60, join_timeout=120)
info = get_rendezvous_handler(params).next_rendezvous()
print("joined as agent", info.rank, flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, tiny_dataset) -> dict:
    """The job on 2 x 1 ranks without a fault: its losses and final weights."""
    return shared_uninterrupted_run(tmp_path_factory, tiny_model_dir, tiny_dataset, 1)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


@pytest.fixture(scope="module")
def side_jobs():
    jobs = SideJobs()
    yield jobs
    jobs.pool.shutdown(wait=True)


def soak(root: Path, reference: dict, model_dir: Path, dataset: Path) -> subprocess.CompletedProcess:
    """bench/kill_relaunch_soak.py: 3 seeded cycles on the job, held to the reference run's output."""
    config = job_config(root / "cfg", model_dir, dataset, root / "unused")
    command = [sys.executable, str(REPO / "bench" / "kill_relaunch_soak.py"), "--config", str(config), "--cycles",
               "3", "--seed", "3", "--workdir", str(root / "soak"), "--reference", str(reference["output"]),
               "--timeout", "600", "--max-stall-s", "150"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=900)
    finally:  # the script kills the nodes it started; they go with it if it is stopped here
        if process.poll() is None:
            kill_tree(process.pid)
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.slow
def test_a_node_dead_as_its_rendezvous_round_completes_holds_the_job_up_seconds_not_minutes(
        cluster, tmp_path, reference, tiny_model_dir, tiny_dataset, side_jobs, tmp_path_factory):
    """rdzv_timeout 120 s: before, node 0's agent waited all of it for the dead agent's share, then its torchrun
    died. Now it gives up within seconds, node 0's launcher starts torchrun again, and node 1 (started once the dead
    agent is gone) meets it in a new round: the job ends as the uninterrupted run did. The soak runs beside it."""
    side_jobs.start("soak", lambda: soak(tmp_path_factory.mktemp("soak"), reference, tiny_model_dir, tiny_dataset))
    try:
        node_dead_as_its_round_completes(cluster, tmp_path, reference, tiny_model_dir, tiny_dataset)
    finally:  # it ends within this test: no `alone` test elsewhere starts beside it
        side_jobs.wait("soak")


def node_dead_as_its_round_completes(cluster: Cluster, tmp_path: Path, reference: dict, tiny_model_dir: Path,
                                     tiny_dataset: Path) -> None:
    from meshtune.doctor.joining import connect_possible
    from meshtune.launch.nodes import _derived_run_id
    from test_node_exits import settings

    output, port = tmp_path / "output", free_port()
    config = job_config(tmp_path / "cfg", tiny_model_dir, tiny_dataset, output, rdzv_timeout=120, preflight=False)
    node0 = cluster.start(0, config, port)
    deadline = time.monotonic() + 120
    while not connect_possible(settings(0, port)):  # node 0's torchrun hosts the rendezvous store
        assert node0.process.poll() is None and time.monotonic() < deadline, node0.output()[-3000:]
        time.sleep(0.1)
    dying = subprocess.run([sys.executable, "-c", DYING_AGENT, f"127.0.0.1:{port}",
                            _derived_run_id("127.0.0.1", port, str(output))],
                           capture_output=True, text=True, timeout=120, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                                                              "PATH": "/usr/bin:/bin"})
    assert "joined as agent" in dying.stdout, dying.stdout + dying.stderr[-3000:]
    died = time.monotonic()
    node1 = cluster.start(1, config, port)
    while len(losses(output) if (output / "metrics.jsonl").exists() else []) == 0:
        assert node0.process.poll() is None and node1.process.poll() is None, node0.output()[-4000:]
        assert time.monotonic() - died < 100, [node0.output()[-3000:], node1.output()[-3000:]]
        time.sleep(0.1)
    for node in (node0, node1):
        assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
    text = node0.output()
    assert "a node left torchrun's rendezvous just as its round completed" in text, text[-4000:]
    assert "DistStoreError" not in text and "Traceback" not in text, text[-4000:]
    assert losses(output) == reference["losses"]
    assert final_hash(output) == reference["hash"]


@pytest.mark.slow
def test_the_kill_relaunch_soak_runs_a_few_seeded_cycles_and_ends_as_the_uninterrupted_run(
        side_jobs, tmp_path_factory, reference, tiny_model_dir, tiny_dataset):
    """bench/kill_relaunch_soak.py: 3 cycles of a random node killed U(3, 25) s after the last relaunch (its whole
    tree), relaunched 1 s later; the final weights equal the reference's and every checkpoint verifies. (The stall
    bound here allows for this test's load, the first test's job beside it; the soak's own default is 60 s.)"""
    result = side_jobs.result("soak", lambda: soak(tmp_path_factory.mktemp("soak"), reference, tiny_model_dir,
                                                   tiny_dataset))
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and report["ok"], result.stdout[-4000:] + result.stderr[-2000:]
    assert report["final_matches"] and report["checkpoints_verified"], report
    assert len(report["kills"]) >= 1, report


def test_a_node_whose_node_0_died_during_the_preflight_waits_for_it_again_and_goes_on(monkeypatch, caplog):
    """Node 0 killed while the nodes run their checks: node 1 does not stop (it would need a relaunch of its own);
    it waits for node 0 again, and the relaunched node 0, back in its job's rendezvous, is met without the checks."""
    import logging

    from meshtune.config import TrainConfig
    from meshtune.launch import preflight
    from test_node_exits import settings

    answers = iter([RuntimeError("Connection reset by peer"),
                    (0, {"skipped": "127.0.0.1:1 answers, but not as node 0's doctor"})])

    def doctor(*args, **kwargs):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(preflight, "run_doctor", doctor)
    monkeypatch.setattr(preflight, "reach_node0", lambda *args, **kwargs: None)
    monkeypatch.setattr(preflight, "RETRY_AFTER_S", 0, raising=False)
    cfg = TrainConfig(model_name_or_path="m", dataset="d", output_dir="o", rdzv_timeout=30)
    with caplog.at_level(logging.INFO):
        preflight.run_preflight(cfg, settings(1, 1), rejoining=False)
    assert "node 1 lost the checks' store at 127.0.0.1:1 (node 0 stopped or died); waiting for node 0 again" in \
        caplog.text
    assert "preflight: skipped: 127.0.0.1:1 answers" in caplog.text
