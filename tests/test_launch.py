"""Node settings (config > env > scheduler > defaults), the torchrun command, and `meshtune launch` end to end.

Unit tests use fake environments and files, never this machine's; one slow test runs a real two-agent job on
127.0.0.1.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import base_config, heavy_imports_of, run_cli, run_cli_here, write_config
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.launch import (describe, detect_node_settings, expand_hostlist, launch_env, needs_torchrun,
                             node_range, torchrun_command, torchrun_worker)
from meshtune.launch import nodes, torchrun

BASE = {"model_name_or_path": "/models/x", "dataset": "train.jsonl", "output_dir": "runs/a"}
TWO_NODES = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555"}
DETECTED_PREFIXES = ("SLURM_", "PBS_", "PET_", "TORCHELASTIC_")
DETECTED_NAMES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "GPUS_PER_NODE",
                  "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@pytest.fixture(autouse=True)
def three_visible_gpus(monkeypatch):
    """The default process count must not depend on the machine running the tests."""
    monkeypatch.setattr(nodes, "default_nproc_per_node", lambda: 3)


@pytest.fixture(autouse=True)
def no_torchrun_numa_binding(monkeypatch):
    """Nor the torchrun command on its GPUs and numactl (tests/test_cpu_affinity.py has the binding)."""
    monkeypatch.setattr(torchrun, "torchrun_numa_binding", lambda mode, nproc: None)


def cfg(**values):
    return build_config({**BASE, **values})


def detect(environ: dict, hostname: str = "host-x", **config):
    return detect_node_settings(cfg(**config), environ=environ, hostname=hostname)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment minus everything node detection reads, plus `extra`."""
    kept = {key: value for key, value in os.environ.items()
            if not key.startswith(DETECTED_PREFIXES) and key not in DETECTED_NAMES}
    return {**kept, "PYTHONUNBUFFERED": "1", **extra}


# precedence


def test_defaults_are_one_node_on_this_machine():
    settings = detect({})
    assert (settings.nnodes, settings.node_rank, settings.master_addr, settings.master_port) == (
        "1", 0, "127.0.0.1", None)
    assert settings.nproc_per_node == 3 and not settings.multi_node
    assert settings.source["nnodes"] == "default" and "visible GPUs" in settings.source["nproc_per_node"]


def test_config_beats_env_beats_scheduler_beats_default():
    slurm = {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "n[1-4]"}
    env = {**slurm, "NODE_RANK": "2", "MASTER_ADDR": "envhost", "MASTER_PORT": "29400"}
    settings = detect(env, node_rank=1)
    assert settings.node_rank == 1 and settings.source["node_rank"] == "config"
    assert settings.master_addr == "envhost" and settings.source["master_addr"] == "env MASTER_ADDR"
    assert settings.nnodes == "4" and settings.source["nnodes"] == "SLURM SLURM_JOB_NUM_NODES"
    assert settings.nproc_per_node == 3 and settings.source["nproc_per_node"].startswith("default")
    assert detect(env).node_rank == 2
    assert detect(slurm, master_port=29400).node_rank == 3


def test_gpus_per_node_is_an_alias_of_nproc_per_node():
    assert detect({"GPUS_PER_NODE": "4"}).nproc_per_node == 4
    both = detect({"GPUS_PER_NODE": "4", "NPROC_PER_NODE": "2"})
    assert both.nproc_per_node == 2 and both.source["nproc_per_node"] == "env NPROC_PER_NODE"
    assert detect({"NPROC_PER_NODE": "auto"}).nproc_per_node == 3  # torchrun's word for the default


def test_empty_env_values_count_as_unset_and_bad_ones_are_named():
    assert detect({"NODE_RANK": "", "NNODES": " "}).nnodes == "1"
    with pytest.raises(ConfigError, match=r"master_port='http' \(from env MASTER_PORT\) is not a whole number from 1 "
                                          r"to 65535"):
        detect({"MASTER_PORT": "http"})
    with pytest.raises(ConfigError, match=r"nproc_per_node='0' \(from env GPUS_PER_NODE\)"):
        detect({"GPUS_PER_NODE": "0"})


# SLURM


@pytest.mark.parametrize("text, hosts", [
    ("login1", ["login1"]),
    ("node[01-04,07],gpu-a[1-2],login1",
     ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2", "login1"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[3],b", ["a3", "b"]),
])
def test_slurm_hostlist_expansion(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-04", "node]1[", "node[4-2]", "node[a-b]", ""])
def test_slurm_hostlist_errors_name_the_variable(text):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(text, "SLURM_JOB_NODELIST")


def test_slurm_job():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_GPUS_ON_NODE": "8", "MASTER_PORT": "29500"}
    settings = detect(env)
    assert (settings.nnodes, settings.node_rank, settings.master_addr, settings.master_port) == ("4", 2, "gpu07", 29500)
    assert settings.nproc_per_node == 8 and settings.run_id == "slurm-4242" and settings.multi_node
    assert settings.source["master_addr"] == "SLURM SLURM_JOB_NODELIST (first host)"
    older = detect({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "a,b",
                    "MASTER_PORT": "29500"})
    assert (older.nnodes, older.node_rank, older.master_addr) == ("2", 1, "a")
    assert detect({**env, "NPROC_PER_NODE": "2"}).nproc_per_node == 2


def test_slurm_with_several_tasks_per_node_says_to_run_one():
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):
        detect({"SLURM_JOB_ID": "1", "SLURM_LOCALID": "3"})


def test_slurm_multi_node_without_a_port_says_how_to_set_one():
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(ConfigError) as err:
        detect(env)
    message = str(err.value)
    assert ("SLURM SLURM_JOB_NUM_NODES" in message and "MASTER_PORT" in message
            and "same free port on every node" in message)


# PBS


@pytest.fixture
def nodefile(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("cn1.cluster\ncn1.cluster\ncn2.cluster\ncn2.cluster\n\ncn3.cluster\ncn1.cluster\n")
    return path


def test_pbs_job_ranks_hosts_by_first_appearance(nodefile):
    env = {"PBS_JOBID": "99.server", "PBS_NODEFILE": str(nodefile), "MASTER_PORT": "29500"}
    settings = detect(env, hostname="cn2")  # short name of cn2.cluster
    assert (settings.nnodes, settings.node_rank, settings.master_addr) == ("3", 1, "cn1.cluster")
    assert settings.run_id == "pbs-99.server" and str(nodefile) in settings.source["node_rank"]
    assert detect(env, hostname="cn3.cluster").node_rank == 2


def test_pbs_host_missing_names_the_file_and_its_hosts(nodefile):
    env = {"PBS_JOBID": "99", "PBS_NODEFILE": str(nodefile), "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError) as err:
        detect(env, hostname="login7")
    message = str(err.value)
    assert str(nodefile) in message and "'login7'" in message and "cn1.cluster, cn2.cluster, cn3.cluster" in message
    assert detect({**env, "NODE_RANK": "2"}, hostname="login7").node_rank == 2  # an explicit rank needs no match


def test_pbs_with_an_unreadable_nodefile_is_an_error_not_a_one_node_job(tmp_path):
    with pytest.raises(ConfigError, match=r"PBS_NODEFILE .*absent cannot be read.*set NNODES, NODE_RANK"):
        detect({"PBS_JOBID": "99", "PBS_NODEFILE": str(tmp_path / "absent")})


# Kubeflow PyTorchJob


def test_pytorchjob_pet_variables():
    env = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": "job", "WORLD_SIZE": "12", "RANK": "2"}
    settings = detect(env)
    assert (settings.nnodes, settings.node_rank, settings.master_addr, settings.master_port) == (
        "3", 2, "job-master-0", 23456)
    assert settings.nproc_per_node == 4 and settings.run_id == "job"
    assert settings.source["nnodes"] == "PyTorchJob PET_NNODES"
    assert detect({**env, "PET_NPROC_PER_NODE": "auto"}).nproc_per_node == 3


def test_pytorchjob_plain_variables_are_pods():
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"}
    settings = detect(env)
    assert (settings.nnodes, settings.node_rank, settings.master_addr) == ("2", 1, "job-master-0")
    assert settings.source["nnodes"] == "PyTorchJob WORLD_SIZE (pods)"
    assert detect({**env, "LOCAL_RANK": "0"}).nnodes == "1"  # a torchrun worker's RANK is not a pod index


def test_torchrun_worker_is_told_by_torchrun_variables_only():
    assert torchrun_worker({"LOCAL_RANK": "0"}) and torchrun_worker({"TORCHELASTIC_RUN_ID": "x"})
    assert not torchrun_worker({"RANK": "1", "WORLD_SIZE": "2"})


# validation


def test_multi_node_needs_master_address_and_port():
    with pytest.raises(ConfigError, match=r"nnodes=2 \(from env NNODES\).*set MASTER_ADDR \(or master_addr:\)"):
        detect({"NNODES": "2", "MASTER_PORT": "29500"})
    with pytest.raises(ConfigError, match=r"nnodes=2 \(from config\).*set MASTER_PORT \(or master_port:\) to the same "
                                          r"free port"):
        detect({"MASTER_ADDR": "10.0.0.1"}, nnodes="2")


def test_node_rank_must_be_below_nnodes():
    with pytest.raises(ConfigError, match=r"node_rank=2 \(from env NODE_RANK\) is not below nnodes=2 \(from config\)"):
        detect({**TWO_NODES, "NODE_RANK": "2"}, nnodes="2")
    with pytest.raises(ConfigError, match=r"node_rank=1 .* 0 to 0"):
        detect({"NODE_RANK": "1"})


def test_elastic_ranges():
    assert node_range("2") == (2, 2) and node_range("1:4") == (1, 4)
    settings = detect({**TWO_NODES, "NNODES": "1:4", "NPROC_PER_NODE": "2"})
    assert settings.multi_node and (settings.min_nodes, settings.max_nodes, settings.max_processes) == (1, 4, 8)
    assert not detect({}, nnodes="1:1").multi_node
    with pytest.raises(ConfigError, match=r"nnodes='3:2' \(from config\): MIN 3 is above MAX 2"):
        detect(TWO_NODES, nnodes="3:2")
    for bad in ("two", "1-4", "1:", "0"):
        with pytest.raises(ConfigError, match=r"nnodes=.*\(from env NNODES\)"):
            detect({**TWO_NODES, "NNODES": bad})


def test_run_id_is_the_same_on_every_node_of_a_job():
    node0 = detect({**TWO_NODES, "NODE_RANK": "0"})
    node1 = detect(TWO_NODES, learning_rate=1e-3)  # a config mismatch must still meet, for the agreement check
    assert node0.run_id == node1.run_id and node0.run_id.startswith("meshtune-")
    assert detect(TWO_NODES, output_dir="runs/b").run_id != node0.run_id
    assert detect({**TWO_NODES, "MASTER_PORT": "29556"}).run_id != node0.run_id


# the torchrun command


def test_single_node_command_is_standalone():
    settings = detect({"NPROC_PER_NODE": "2"})
    command = torchrun_command(settings, ["train", "c.yaml"], cfg(max_restarts=2))
    assert command == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "--max-restarts", "2", "-m", "meshtune", "train", "c.yaml"]
    assert needs_torchrun(settings) and not needs_torchrun(detect({"NPROC_PER_NODE": "1"}))
    assert launch_env(settings) == {"MESHTUNE_NODE_RANK": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}


def test_multi_node_command():
    config = cfg(rdzv_timeout=120, max_restarts=5)
    settings = detect_node_settings(config, environ={**TWO_NODES, "NPROC_PER_NODE": "4"})
    command = torchrun_command(settings, ["train", "c.yaml", "seed=1"], config)
    assert command == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.2.3:29555",
                       "--rdzv-conf", "join_timeout=120,read_timeout=15,is_host=0", "--rdzv-id", settings.run_id,
                       "--max-restarts", "5", "-m", "meshtune", "train", "c.yaml", "seed=1"]
    node0 = detect_node_settings(config, environ={**TWO_NODES, "NODE_RANK": "0"})
    assert "join_timeout=120,read_timeout=15,is_host=1" in torchrun_command(node0, ["train"], config)
    with_addr = cfg(rdzv_timeout=120, local_addr="10.9.9.9")
    assert torchrun_command(settings, ["train"], with_addr)[-5:-3] == ["--local-addr", "10.9.9.9"]
    assert "--node-rank" not in command  # ignored by c10d; the rank travels as MESHTUNE_NODE_RANK
    assert launch_env(settings, stop_grace_period=120) == {"MESHTUNE_NODE_RANK": "1",
                                                           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                                           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "150"}
    ipv6 = detect({**TWO_NODES, "MASTER_ADDR": "fd00::1"})
    assert "[fd00::1]:29555" in torchrun_command(ipv6, ["train"], config)


def test_describe_says_where_each_value_came_from():
    text = describe(detect({**TWO_NODES, "GPUS_PER_NODE": "4"}))
    for expected in ("10.1.2.3:29555", "env NNODES", "env NODE_RANK", "env MASTER_ADDR", "env MASTER_PORT",
                     "env GPUS_PER_NODE", "8 in all", "meshtune-"):
        assert expected in text
    assert describe(detect({})) == "meshtune: 1 node, 3 processes (from default: visible GPUs, 1 on CPU)"


# through the real CLI


@pytest.mark.slow
def test_dry_run_prints_settings_and_the_command(tmp_path):
    path = write_config(tmp_path, model_name_or_path=str(tmp_path / "no-model"), dataset="no-data.jsonl",
                        nproc_per_node=1)
    process, imported = heavy_imports_of(["launch", "--dry-run", str(path), "max_steps=3"], clean_env(**TWO_NODES))
    assert process.returncode == 0, process.stderr[-3000:]
    assert "--rdzv-endpoint 10.1.2.3:29555" in process.stdout and "MESHTUNE_NODE_RANK=1" in process.stdout
    assert "env NODE_RANK" in process.stdout and process.stdout.rstrip().endswith(f"train {path} max_steps=3")
    assert imported == []  # it starts nothing: neither torch nor transformers (a fraction of a second)


def test_launch_help_explains_env_and_schedulers(capfd):
    result = run_cli_here(["launch", "--help"], capfd)
    assert result.returncode == 0
    for expected in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "SLURM_JOB_NODELIST",
                     "PBS_NODEFILE", "PET_NNODES", "--dry-run"):
        assert expected in result.stdout


def test_options_are_read_before_among_and_after_the_config_and_its_overrides():
    from meshtune.cli import parse_args

    for argv in (["train", "c.yaml", "seed=1", "--debug"], ["train", "c.yaml", "--debug", "seed=1"],
                 ["train", "--debug", "c.yaml", "seed=1"], ["--debug", "train", "c.yaml", "seed=1"]):
        args = parse_args(argv)
        assert (args.command, args.config, args.overrides, args.debug) == ("train", "c.yaml", ["seed=1"], True), argv
    assert not parse_args(["train", "c.yaml", "seed=1"]).debug
    args = parse_args(["launch", "--scheduler", "slurm", "c.yaml", "--nodes", "2", "seed=1", "--use_lora",
                       "--gpus-per-node=4", "max_steps=3"])
    assert (args.scheduler, args.nodes, args.gpus_per_node) == ("slurm", 2, 4)
    assert (args.config, args.overrides, args.flags, args.debug) == ("c.yaml", ["seed=1", "max_steps=3"],
                                                                     {"use_lora": True}, False)
    args = parse_args(["doctor", "c.yaml", "--timeout", "5", "seed=1", "--bandwidth"])
    assert (args.timeout, args.bandwidth, args.overrides) == (5.0, True, ["seed=1"])
    assert parse_args(["--debug", "ckpt", "verify", "out/checkpoint-2"]).debug
    assert parse_args(["ckpt", "verify", "out/checkpoint-2", "--debug"]).debug
    assert not parse_args(["ckpt", "list", "out"]).debug


def test_more_processes_than_a_cuda_nodes_gpus_is_a_named_error_before_any_process_starts(tmp_path, monkeypatch,
                                                                                            capfd):
    from conftest import run_cli_here, write_config
    from meshtune import cpu_affinity
    from meshtune.errors import ConfigError
    from meshtune.launch import torchrun
    from meshtune.launch.supervise import check_gpu_processes

    with pytest.raises(ConfigError, match=r"nproc_per_node 2 \(from config\) on a node with 1 visible CUDA GPU: each "
                                          r"process needs a GPU of its own; set nproc_per_node: 1"):
        check_gpu_processes(2, "config", gpus=1)
    check_gpu_processes(2, "config", gpus=2)
    check_gpu_processes(8, "config", gpus=0)  # no CUDA: the processes train on the cores

    monkeypatch.setattr(cpu_affinity, "cuda_device_count", lambda: 1)  # a one-GPU machine
    monkeypatch.setattr(torchrun, "run_torchrun", lambda *args, **kwargs: pytest.fail("torchrun was started"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = write_config(tmp_path, model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "d.jsonl"),
                          output_dir=str(tmp_path / "out"), nproc_per_node=2)
    result = run_cli_here(["train", str(config)], capfd)
    assert result.returncode != 0 and "nproc_per_node 2 (from " in result.stdout and "1 visible CUDA GPU" in \
        result.stdout and "Traceback" not in result.stdout, result.stdout
    assert not (tmp_path / "out").exists()


def test_cpu_process_counts_far_above_the_cores_are_refused_and_above_them_warned(capsys):
    from meshtune.errors import ConfigError
    from meshtune.launch.supervise import check_cpu_processes

    with pytest.raises(ConfigError, match="nproc_per_node 64 on a machine with no GPU and 2 CPU cores"):
        check_cpu_processes(64, cores=2, cuda=False)
    check_cpu_processes(4, cores=2, cuda=False)
    assert "nproc_per_node 4 is more than this machine's 2 CPU cores" in capsys.readouterr().out
    check_cpu_processes(2, cores=2, cuda=False)
    check_cpu_processes(64, cores=2, cuda=True)  # GPUs do the work
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_named_error_in_the_workers_is_printed_once_without_torchruns_traceback(tmp_path, tiny_model_dir,
                                                                                 tiny_dataset):
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", nproc_per_node=2,
                                                  lora_target="q_projx"))
    result, _ = run_cli(["train", str(config)], timeout=180)
    assert result.returncode == 1, result.stdout[-3000:]
    assert result.stdout.count("lora_target: q_projx names no linear layer of the model") == 1, result.stdout[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith(
        "meshtune: error: lora_target: q_projx names no linear layer")
    assert "Traceback" not in result.stdout and "SignalException" not in result.stdout


def test_the_agent_filter_drops_only_torchruns_own_stop_traceback():
    import io

    from meshtune.launch.torchrun import AgentTracebackFilter

    stream = io.BytesIO(b"W agent: shutting down workers\n"
                        b"Traceback (most recent call last):\n  File \"run.py\", line 1\n    main()\n"
                        b"torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15\n"
                        b"Traceback (most recent call last):\n  File \"worker.py\", line 2\n"
                        b"RuntimeError: a worker's own failure\n"
                        b"Traceback (most recent call last):\n  File \"cut.py\", line 3\n")
    sink = io.BytesIO()
    AgentTracebackFilter(sink).copy(stream)
    assert sink.getvalue() == (b"W agent: shutting down workers\n"
                               b"Traceback (most recent call last):\n  File \"worker.py\", line 2\n"
                               b"RuntimeError: a worker's own failure\n"
                               b"Traceback (most recent call last):\n  File \"cut.py\", line 3\n")


def logging_error_block(exception: Exception) -> bytes:
    """What Python's logging prints when `exception` interrupts a handler writing a record."""
    import contextlib
    import io
    import logging

    class Interrupted(io.StringIO):
        def write(self, text):
            raise exception

    handler, stderr = logging.StreamHandler(Interrupted()), io.StringIO()
    with contextlib.redirect_stderr(stderr):
        handler.handle(logging.LogRecord("torch", logging.WARNING, "api.py", 1, "Sending process %s closing signal %s",
                                         (4310, "SIGTERM"), None))
    return stderr.getvalue().encode()


def test_the_agent_filter_drops_a_logging_error_its_stop_signal_caused_and_keeps_others():
    import io

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from meshtune.launch.torchrun import AgentTracebackFilter

    stopped = logging_error_block(SignalException("Process 1 got signal: 15", sigval=15))
    other = logging_error_block(ValueError("a handler's own failure"))
    assert stopped.startswith(b"--- Logging error ---\nTraceback") and b"Arguments: (4310, 'SIGTERM')" in stopped
    sink = io.BytesIO()
    AgentTracebackFilter(sink).copy(io.BytesIO(b"W agent: shutting down workers\n" + stopped + other +
                                               b"meshtune: error: step 6: the loss was not finite\n"))
    assert sink.getvalue() == b"W agent: shutting down workers\n" + other + \
        b"meshtune: error: step 6: the loss was not finite\n"


def test_the_agent_filter_drops_a_chained_store_loss_traceback_and_notes_it():
    import io

    from meshtune.launch.torchrun import AgentTracebackFilter

    stream = io.BytesIO(b"Traceback (most recent call last):\n  File \"store.py\", line 1\n"
                        b"torch.distributed.DistNetworkError: Failed to recv\n\n"
                        b"The above exception was the direct cause of the following exception:\n\n"
                        b"Traceback (most recent call last):\n  File \"run.py\", line 2\n"
                        b"torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: store failed\n"
                        b"meshtune: a line after it\n")
    sink = io.BytesIO()
    kept = AgentTracebackFilter(sink)
    kept.copy(stream)
    assert sink.getvalue() == b"meshtune: a line after it\n" and kept.store_lost


def test_the_agent_filter_drops_the_rendezvous_tracebacks_the_launcher_explains_and_notes_them():
    """The agent's wait for a node's share after a round (its keys are the round's), a rendezvous that never
    completed, one another agent closed: the launcher says each in its own words. A worker's DistStoreError on its
    own keys stays."""
    import io

    from meshtune.launch.torchrun import AgentTracebackFilter

    stream = io.BytesIO(b"Traceback (most recent call last):\n  File \"api.py\", line 1\n"
                        b"torch.distributed.DistStoreError: wait timeout after 15000ms, keys: "
                        b"/torch.rendezvous.meshtune-1.3/torchelastic/role_info/0, "
                        b"/torch.rendezvous.meshtune-1.3/torchelastic/role_info/1\n"
                        b"Traceback (most recent call last):\n  File \"run.py\", line 2\n"
                        b"torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n"
                        b"Traceback (most recent call last):\n  File \"run.py\", line 2\n"
                        b"torch.distributed.elastic.rendezvous.api.RendezvousClosedError\n"
                        b"Traceback (most recent call last):\n  File \"worker.py\", line 3\n"
                        b"torch.distributed.DistStoreError: wait timeout after 60000ms, keys: /default_pg/0//cpu\n")
    sink = io.BytesIO()
    kept = AgentTracebackFilter(sink)
    kept.copy(stream)
    assert sink.getvalue() == (b"Traceback (most recent call last):\n  File \"worker.py\", line 3\n"
                               b"torch.distributed.DistStoreError: wait timeout after 60000ms, keys: "
                               b"/default_pg/0//cpu\n")
    assert kept.rank_exchange_lost and kept.rendezvous_closed and not kept.store_lost


@pytest.mark.slow
def test_the_launchers_last_line_starts_on_a_line_of_its_own_after_a_cut_progress_bar(capsys):
    """A worker stopped mid-step leaves its progress bar without a newline; the launcher's error or stop line must
    not be glued to it (tests and users read the last line)."""
    from meshtune.launch.torchrun import end_workers_line, run_torchrun

    run_torchrun([sys.executable, "-c", "import sys; sys.stderr.write('loading\\ntrain:  15%|##  | 6/40\\r')"], 1)
    assert capsys.readouterr().err == "loading\ntrain:  15%|##  | 6/40\r"  # copied as it came, line unfinished
    end_workers_line()
    assert capsys.readouterr().err == "\n"
    end_workers_line()  # nothing ran since
    assert capsys.readouterr().err == ""
    # after torchrun ran, whatever its workers printed (or wrote past the copy, straight to the terminal)
    run_torchrun([sys.executable, "-c", "print('done')"], 1)
    capsys.readouterr()
    end_workers_line()
    assert capsys.readouterr().err == "\n"


def test_a_command_runs_with_rare_collections_and_gives_the_callers_thresholds_back(monkeypatch, capfd, tmp_path):
    """Every command's imports run with the first generation collected every 100,000 new objects, not 700; a caller
    of main() (a test, a notebook) gets its own thresholds back, also when the command fails."""
    import gc

    from meshtune import cli

    seen = []
    monkeypatch.setattr(cli, "run_command", lambda args: seen.append(gc.get_threshold()) or 0)
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        assert run_cli_here(["launch", "--dry-run", str(tmp_path / "cfg.yaml")], capfd).returncode == 0
        assert seen == [cli.COMMAND_GC_THRESHOLD] and gc.get_threshold() == (700, 10, 10)
        monkeypatch.setattr(cli, "run_command", lambda args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            cli.main(["launch", "--dry-run", str(tmp_path / "cfg.yaml")])
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
