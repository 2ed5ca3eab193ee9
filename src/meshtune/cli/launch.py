"""`meshtune launch`: this node's part of a job, or (`--scheduler`) a job file for the whole job."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from meshtune.cli.job import load_training_config
from meshtune.errors import MeshtuneError
from meshtune.launch.supervise import launch_training


LAUNCH_HELP = """\
Run this node's part of a training job: the same command on every node, only the node rank differs.
Prints where each setting came from, then starts torchrun (c10d rendezvous at MASTER_ADDR:MASTER_PORT,
--max-restarts max_restarts) or, for one process on one node, trains directly. Same arguments as `train`.

With --scheduler slurm|pbs|k8s it starts nothing and writes a job file for the whole job instead (to stdout, or
--output FILE): an sbatch script, a PBS job script, or a Kubeflow PyTorchJob with the config in a ConfigMap. The
config is checked first; each node of the job runs `meshtune launch` on it with the same overrides, and the file
stops the training with a checkpoint before a time limit and runs it again (resuming) after a requeue.
docs/schedulers/ has one page per scheduler.
"""


LAUNCH_EPILOG = """\
where each setting comes from (the first that has it wins):
  1. config keys (YAML or key=value): nnodes, node_rank, master_addr, master_port, nproc_per_node
  2. env: NNODES (N, or MIN:MAX for elastic), NODE_RANK, MASTER_ADDR, MASTER_PORT,
     NPROC_PER_NODE (or GPUS_PER_NODE)
  3. the scheduler:
     SLURM (SLURM_JOB_ID): SLURM_JOB_NUM_NODES, SLURM_NODEID, first host of SLURM_JOB_NODELIST,
       SLURM_GPUS_ON_NODE; run one task per node (srun --ntasks-per-node=1)
     PBS (PBS_JOBID, PBS_NODEFILE): the node file's hosts; node 0 is the first, this node's rank its place
     Kubeflow PyTorchJob: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE;
       else WORLD_SIZE pods and RANK = this pod's index
  4. defaults: 1 node, rank 0, 127.0.0.1, one process per visible GPU (1 on CPU)
Several nodes need MASTER_PORT (or master_port:) set to the same free port on every node: no scheduler
gives one, and a random port per node never meets.

examples:
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node01 MASTER_PORT=29500 meshtune launch cfg.yaml   # on node01
  NNODES=2 NODE_RANK=1 MASTER_ADDR=node01 MASTER_PORT=29500 meshtune launch cfg.yaml   # on node02
  MASTER_PORT=29500 srun --ntasks-per-node=1 meshtune launch cfg.yaml                  # in an sbatch script
  meshtune launch --dry-run cfg.yaml       # print this node's settings and torchrun command, start nothing
  meshtune launch --scheduler slurm cfg.yaml --nodes 4 --gpus-per-node 8 --time 24:00:00 --output job.sbatch
  meshtune launch --scheduler pbs cfg.yaml --nodes 2 --gpus-per-node 4 --queue gpu --output job.pbs
  meshtune launch --scheduler k8s cfg.yaml output_dir=/shared/runs/a --nodes 2 --gpus-per-node 8 \\
      --image registry.example.com/meshtune:1.0 --pvc shared-rwx --output job.yaml
"""


SCHEDULER_OPTIONS = ("--scheduler", "--nodes", "--gpus-per-node", "--cpus-per-node", "--time", "--job-name",
                     "--output", "--python", "--partition", "--account", "--queue", "--image", "--pvc", "--namespace",
                     "--elastic", "--mount")


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune launch` and its options on meshtune's parser."""
    launch = commands.add_parser("launch", help="run this node's part of a one- or many-node job", parents=[job, debug],
                                 description=LAUNCH_HELP, epilog=LAUNCH_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_argument("--dry-run", action="store_true",
                        help="print this node's settings and the exact command, start nothing")
    add_scheduler_options(launch)


def add_scheduler_options(launch: argparse.ArgumentParser) -> None:
    from meshtune.launch.scheduler_files import SCHEDULERS

    group = launch.add_argument_group("job file (--scheduler: write it, start nothing)")
    group.add_argument("--scheduler", choices=SCHEDULERS, help="write a job file for this scheduler")
    group.add_argument("--nodes", type=int, metavar="N", help="nodes of the job")
    group.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs each node gets (0: CPU only)")
    group.add_argument("--cpus-per-node", type=int, metavar="C",
                       help="CPU cores each node gets (default: the scheduler's)")
    group.add_argument("--time", metavar="LIMIT", help="slurm, pbs: time limit, minutes or [DAYS-]HH:MM:SS")
    group.add_argument("--job-name", metavar="NAME", help="default: output_dir's last part")
    group.add_argument("--output", metavar="FILE", help="write the file here (default: stdout)")
    group.add_argument("--python", metavar="PATH", help="the python every node runs meshtune with (default: this one; "
                                                        "k8s: the image's meshtune)")
    group.add_argument("--partition", help="slurm: the partition")
    group.add_argument("--account", help="slurm, pbs: the account charged")
    group.add_argument("--queue", help="pbs: the queue")
    group.add_argument("--image", help="k8s (required): the container image, with meshtune installed")
    group.add_argument("--pvc", metavar="NAME", help="k8s (required): a ReadWriteMany PersistentVolumeClaim mounted at "
                                                     "output_dir")
    group.add_argument("--namespace", help="k8s: the namespace")
    group.add_argument("--elastic", metavar="MIN:MAX", help="k8s: an elastic job of MIN to MAX pods")
    group.add_argument("--mount", action="append", metavar="CLAIM:PATH[:ro]",
                       help="k8s: a PersistentVolumeClaim mounted at PATH in every pod (read-only with :ro), for the "
                            "model and data the config names; repeat it for several")


def run(args: argparse.Namespace) -> int:
    from meshtune.launch import describe, detect_node_settings, launch_env, needs_torchrun, torchrun_command

    given = [option for option in SCHEDULER_OPTIONS if getattr(args, option[2:].replace("-", "_")) is not None]
    if args.scheduler:
        return write_job_file(args, given)
    if given:
        raise MeshtuneError(f"{', '.join(given)}: options of a job file; add --scheduler slurm, pbs or k8s")
    cfg, argv = load_training_config(args)
    if not args.dry_run:
        return launch_training(cfg, argv, debug=args.debug)
    settings = detect_node_settings(cfg)
    print(describe(settings))
    if needs_torchrun(settings):
        env = [f"{key}={value}" for key, value in launch_env(settings, cfg.stop_grace_period).items()]
        print(shlex.join([*env, *torchrun_command(settings, argv, cfg)]))
    else:
        print(f"one process: trains in this process, no torchrun ({shlex.join(['meshtune', *argv])})")
    return 0


def write_job_file(args: argparse.Namespace, given: list[str]) -> int:
    """`launch --scheduler`: the config checked as for training, then the job file written, nothing started."""
    import os

    from meshtune.launch.scheduler_files import JobRequest, job_file, unmounted_warning

    if args.dry_run:
        raise MeshtuneError("--dry-run and --scheduler: --scheduler starts nothing either; leave out --dry-run")
    if args.nodes is None or args.gpus_per_node is None:
        raise MeshtuneError("--scheduler needs --nodes N and --gpus-per-node G (0 for CPU only)")
    cfg, _ = load_training_config(args)
    job = JobRequest(
        scheduler=args.scheduler, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        config=Path(args.config).absolute() if args.config else None,
        launch_args=[*args.overrides, *args.flag_tokens], workdir=Path.cwd(),
        python=args.python or (None if args.scheduler == "k8s" else sys.executable),
        command_line=args.command_line, job_name=args.job_name, time=args.time, cpus_per_node=args.cpus_per_node,
        partition=args.partition, account=args.account, queue=args.queue, image=args.image, pvc=args.pvc,
        namespace=args.namespace, elastic=args.elastic, mount=tuple(args.mount) if args.mount else None,
        deepspeed=deepspeed_named(args),
        given=tuple(option[2:].replace("-", "_") for option in given))
    text = job_file(job, cfg)
    if warning := unmounted_warning(job, cfg):
        print(f"meshtune: warning: {warning}", file=sys.stderr)
    if not args.output:
        sys.stdout.write(text)
        return 0
    Path(args.output).write_text(text)
    if args.scheduler != "k8s":
        os.chmod(args.output, 0o755)
    submit = {"slurm": "sbatch", "pbs": "qsub", "k8s": "kubectl apply -f"}[args.scheduler]
    print(f"meshtune: wrote {args.output}; submit it with: {submit} {args.output}")
    return 0


def deepspeed_named(args: argparse.Namespace) -> str | None:
    """The DeepSpeed JSON the job's config, flags or overrides name (the last wins, as for every key)."""
    from meshtune.config import load_yaml, parse_overrides

    values = {**(load_yaml(args.config) if args.config else {}), **args.flags, **parse_overrides(args.overrides)}
    return str(values["deepspeed"]) if values.get("deepspeed") else None
