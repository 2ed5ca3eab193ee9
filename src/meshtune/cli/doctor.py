"""`meshtune doctor`: the checks every node runs before a multi-node job, and the link between them."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtune.cli.job import load_training_config


DOCTOR_HELP = """\
Run on every node, with the environment training will have (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
NPROC_PER_NODE, or SLURM / PBS / PyTorchJob), the same command on each: `meshtune doctor cfg.yaml`.
The nodes meet on MASTER_ADDR:MASTER_PORT (node 0 hosts a small key-value store there and releases it on exit);
node 0 prints one table, a row per check and a column per node, each cell ✔ / ✘ / ! with the fix below it:
  - every node joined within --timeout, with its own NODE_RANK below NNODES
  - NNODES, MASTER_ADDR, MASTER_PORT and processes per node agree; so do the config keys all nodes share
  - GPUs (count, model), driver, CUDA and NCCL versions; torch, transformers, peft, torchao and meshtune
    versions and a hash of meshtune's installed code
  - model and dataset files: present, with node 0's checksums (cached by path, size and time: hashed once)
  - output_dir writable, one storage for all nodes, room for the checkpoints kept
  - clocks against node 0; the interface that routes to MASTER_ADDR, with the NCCL_SOCKET_IFNAME /
    GLOO_SOCKET_IFNAME to set when another would be used; InfiniBand devices
With --bandwidth the nodes then form a torch.distributed process group (gloo on CPU, NCCL when every node has
GPUs; one process a node, in the doctor's store) and measure all-reduce from 1 KiB (latency) up to 16 MiB (CPU) or
256 MiB (GPU), as nccl-tests reports it (algbw = bytes / time, busbw = algbw x 2(n-1)/n), then each pair of
nodes, so a slow link is named; node 0 judges the link against what the config moves across nodes each optimizer
step under its parallel mode (rows: all-reduce bus bandwidth, latency, slowest pair, verdict for <parallel>).
The other nodes print the rows that concern them. Exit code 1 when any check fails (✘).
`meshtune train` runs these checks itself before starting torchrun on several nodes (config key preflight).
"""


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune doctor` and its options on meshtune's parser."""
    doctor = commands.add_parser("doctor", help="check every node before a multi-node run (run it on each node)",
                                 parents=[job, debug], description=DOCTOR_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the other nodes (default 30): a node that has not joined by then "
                             "is named in the table")
    doctor.add_argument("--json", metavar="FILE", help="node 0 also writes the table as JSON here")
    doctor.add_argument("--bandwidth", action="store_true",
                        help="also measure the link between the nodes (all-reduce and each pair; under 60 s on "
                             "healthy nodes) and judge it against what this config moves each step")


def run(args: argparse.Namespace) -> int:
    import json

    from meshtune.launch import detect_node_settings
    from meshtune.doctor.meeting import run_doctor
    from meshtune.model.custom_code import refuse_custom_code

    cfg, _ = load_training_config(args)
    refuse_custom_code(cfg.model_name_or_path)  # a job that could never start: said before the nodes meet
    code, report = run_doctor(cfg, detect_node_settings(cfg), args.timeout, bandwidth=args.bandwidth,
                              progress=lambda line: print(f"meshtune doctor: {line}", flush=True))
    if "skipped" in report:
        print(f"meshtune doctor: nothing checked: {report['skipped']}")
    if args.json and report.get("columns") is not None:
        Path(args.json).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return code
