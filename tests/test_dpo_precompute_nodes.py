"""A DPO job with precomputed reference log-probs on 2 simulated nodes x 2 processes (torchrun agents on 127.0.0.1,
full fine-tuning under hsdp: a replica a node) resumes exactly after one node is killed.

The uninterrupted job (tests/ranks.py's forked ranks, told they are 2 nodes of 2) computes the values across its 4
ranks and keeps them beside the tokenized cache; the job on the two torchrun agents reads them (never computing them
again, nor building the frozen copy; node 1, whose tokenized_path is a disk of its own without them, takes node 0's and
keeps them), loses node 1 to kill -9 after checkpoint-4, relaunches it, and ends with the uninterrupted job's losses
and final weights bit for bit (CPU / gloo, one thread a process)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import LLAMAFACTORY_DATA, base_config, read_metrics, write_config
from ranks import free_port, run_workers, wait_for_port
from test_faults import JOB_TIMEOUT, Cluster, final_hash, wait_for_checkpoint

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY, PER_NODE = 12, 4, 2  # 12 pairs: 3 steps of 4 an epoch


def job_config(directory: Path, model_dir: Path, output: Path, tokenized: Path) -> Path:
    values = base_config(model_dir, "dpo_en_demo", output, stage="dpo", dataset_dir=str(LLAMAFACTORY_DATA),
                         finetuning_type="full", parallel="hsdp", hsdp_shard_size=PER_NODE, learning_rate=1e-3,
                         cutoff_len=256, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                         max_steps=STEPS, save_steps=SAVE_EVERY, precompute_ref_log_probs=True,
                         tokenized_path=str(tokenized), rdzv_timeout=60, ddp_timeout=60, max_restarts=3,
                         nproc_per_node=None)
    return write_config(directory, **values)


def losses(output: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("dpo_precompute_nodes")
    tokenized = root / "tokenized"
    through = root / "through"
    config = job_config(root / "through-cfg", tiny_model_dir, through, tokenized)
    codes, through_log = run_workers(["train", str(config)], 2 * PER_NODE, root / "ranks", timeout=JOB_TIMEOUT,
                                     env={"OMP_NUM_THREADS": "1"}, per_node=PER_NODE)
    assert codes == [0] * (2 * PER_NODE), through_log[-6000:]
    output = root / "output"
    config = job_config(root / "cfg", tiny_model_dir, output, tokenized)
    cluster = Cluster(root)
    try:
        port = free_port()
        own_cache = [f"tokenized_path={root / 'node1-tokenized'}"]  # a node's disk of its own: no values there
        nodes = [cluster.start(0, config, port, per_node=PER_NODE)]
        wait_for_port(port, nodes[0].process, timeout=JOB_TIMEOUT)
        nodes.append(cluster.start(1, config, port, per_node=PER_NODE, overrides=own_cache))
        wait_for_checkpoint(output, SAVE_EVERY, nodes[0])
        nodes[1].kill()  # a dead machine: its agent and both its workers
        assert not (output / "final").exists(), "the job ended before the kill: nothing was tested"
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # node 0 must outlive the loss of node 1 (a duration: no condition)
            assert nodes[0].process.poll() is None, nodes[0].output()[-3000:]
            time.sleep(0.05)
        nodes[1] = cluster.start(1, config, port, per_node=PER_NODE, overrides=own_cache)
        for node in nodes:
            assert node.wait(JOB_TIMEOUT) == 0, node.output()[-4000:]
        return {"through": through, "through_log": through_log, "output": output, "caches": [tokenized,
                                                                                         root / "node1-tokenized"],
                "logs": [node.output() for node in cluster.nodes]}
    finally:
        cluster.cleanup()


def test_a_killed_node_relaunched_resumes_a_precomputed_dpo_job_bit_for_bit(jobs):
    through, output = jobs["through"], jobs["output"]
    assert len(losses(through)) == STEPS and losses(output) == losses(through)
    assert final_hash(output) == final_hash(through)
    node0 = jobs["logs"][0]
    assert f"resumed from {output / f'checkpoint-{SAVE_EVERY}'}" in node0, node0[-4000:]


def test_the_values_are_computed_once_across_the_ranks_then_read_by_every_start(jobs):
    assert "the reference's log-probs of 12 pairs computed in" in jobs["through_log"]
    assert "on 4 process(es)" in jobs["through_log"]
    logs = "".join(jobs["logs"])
    assert "log-probs of 12 pairs computed" not in logs and "is damaged" not in logs
    node0 = jobs["logs"][0]
    assert node0.count("precomputed before the first step (read from") == 2, node0[-4000:]  # the start, the restart
    # node 1 started without them: it took rank 0's values and kept them on its own disk, read at its relaunch
    assert node0.count("differs between the nodes or is missing on some") == 1, node0[-4000:]
    kept = [sorted(cache.glob("*.reference-*/logps.npy")) for cache in jobs["caches"]]
    assert len(kept[0]) == len(kept[1]) == 1 and kept[0][0].read_bytes() == kept[1][0].read_bytes()
