"""A real SLURM cluster on this machine for the tests: munged, slurmctld and two slurmd nodes, each node in its
own network namespace with its own host name, joined by a bridge, so a two-node job reaches node 0 by name over
a network as on a real cluster.

Everything lives in a temporary folder (key, config, state, spool, logs); the daemons are foreground processes
of this one, stopped by PID, and every process left in a node's namespace (job steps) is killed by PID before
the namespace goes. Needs root (namespaces, slurmd); the packages are installed with apt-get when missing.
`SlurmUnavailable` says why a cluster cannot be had, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from processes import alive, kill_tree

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")  # slurm-wlm would add slurmdbd and slurmrestd
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged")
INSTALL_TIMEOUT = 600  # a cold apt-get update plus the download of about 10 MB on a slow mirror
# the daemons and munged live in sbin, which a user's PATH may lack
PATH = os.pathsep.join(dict.fromkeys(filter(None, [*os.environ.get("PATH", "").split(os.pathsep),
                                                   "/usr/sbin", "/sbin"])))


def _found(program: str) -> bool:
    return shutil.which(program, path=PATH) is not None


class SlurmUnavailable(Exception):
    """No cluster on this machine, and why (a test skips with it)."""


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]  # os.environ plus SLURM_CONF: for sbatch, scontrol, sinfo and the jobs they start
    nodes: list[str]
    logs: list[Path] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 30) -> str:
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def sbatch(self, script: Path, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submits `script` from `cwd` with this environment plus `env` (sbatch's default --export=ALL passes it
        on to the job); the job id."""
        result = subprocess.run(["sbatch", "--parsable", str(script)], env={**self.env, **(env or {})}, cwd=cwd,
                                capture_output=True, text=True, timeout=30)
        if result.returncode:
            raise RuntimeError(f"sbatch {script} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...): without slurmdbd there is
        no sacct, and slurmctld keeps a finished job for MinJobAge seconds."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_job(self, job_id: str, states: set[str], timeout: float, poll: float = 0.5) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not {' or '.join(sorted(states))} within {timeout} s: {info}\n"
                                   + self.log_tails())
            time.sleep(poll)

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {log.name}\n{_tail(log, lines)}" for log in self.logs if log.exists())


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def ensure_installed() -> float:
    """Seconds spent installing the packages (0 when present); SlurmUnavailable when they cannot be."""
    if all(_found(program) for program in PROGRAMS):
        return 0.0
    if os.geteuid() != 0:
        raise SlurmUnavailable("SLURM is not installed and installing it needs root")
    if not _found("apt-get"):
        raise SlurmUnavailable("SLURM is not installed and there is no apt-get to install it")
    started = time.monotonic()
    env = {**os.environ, "PATH": PATH, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        if result.returncode:  # package lists missing or stale
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=INSTALL_TIMEOUT)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"apt-get did not install {' '.join(PACKAGES)} within {INSTALL_TIMEOUT} s") from None
    if result.returncode or not all(_found(program) for program in PROGRAMS):
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {result.stderr.strip()[-800:]}")
    return time.monotonic() - started


@contextlib.contextmanager
def slurm_cluster(node_count: int = 2, start_timeout: float = 60) -> Iterator[SlurmCluster]:
    """The running cluster; everything it started is stopped and removed on the way out."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("a SLURM cluster needs root (network namespaces, slurmd)")
    ensure_installed()
    with contextlib.ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="meshtune-slurm-"))
        root.chmod(0o755)  # munged's socket must be reachable through every folder above it
        for folder in ("state", "spool", "log", "run"):
            (root / folder).mkdir()
        stack.callback(shutil.rmtree, root, True)
        net = stack.enter_context(_network(node_count))
        cluster = SlurmCluster(root, {}, [f"n{i + 1}" for i in range(node_count)])
        munge_socket = stack.enter_context(_munged(root, cluster))
        ctld_port = _free_port()
        conf = _write_config(root, cluster.nodes, net, munge_socket, ctld_port)
        cluster.env = {**os.environ, "PATH": PATH, "SLURM_CONF": str(conf)}
        for name in ("slurmctld.log", *(f"slurmd-{node}.log" for node in cluster.nodes)):
            cluster.logs.append(root / "log" / name)
        stack.enter_context(_daemon(["slurmctld", "-D", "-i", "-f", str(conf)], cluster, "slurmctld"))
        _wait_for_port(net.controller, ctld_port, start_timeout, cluster)
        for node, namespace, address in zip(cluster.nodes, net.namespaces, net.node_addresses):
            hosts = root / f"hosts-{node}"
            hosts.write_text("127.0.0.1 localhost\n" + "".join(
                f"{a} {n}\n" for n, a in zip(cluster.nodes, net.node_addresses)) + f"{net.controller} slurmctld\n")
            # the node's own mount and UTS namespaces: /etc/hosts names every node, `hostname` says this node's name
            inner = f"mount --bind {hosts} /etc/hosts && hostname {node} && exec slurmd -D -N {node} -f {conf}"
            stack.callback(_kill_namespace_processes, namespace)  # job steps: slurmstepd leaves slurmd's tree
            # nsenter, not `ip netns exec`, which mounts a new /sys without the cgroup folders slurmd looks for
            (root / "spool" / node).mkdir()
            stack.enter_context(_daemon(["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--mount", "--uts",
                                         "sh", "-c", inner], cluster, f"slurmd {node}"))
        _wait_for_idle_nodes(cluster, start_timeout)
        yield cluster


@dataclass
class _Network:
    controller: str
    node_addresses: list[str]
    namespaces: list[str]


@contextlib.contextmanager
def _network(node_count: int) -> Iterator[_Network]:
    """A bridge holding the controller's address, and one namespace per node wired to it by a veth pair."""
    tag = f"{os.getpid() % 100000}"
    subnet = _unused_subnet()
    hosts = list(subnet.hosts())
    net = _Network(str(hosts[0]), [str(hosts[10 + i]) for i in range(node_count)],
                   [f"meshtune-slurm-{tag}-n{i + 1}" for i in range(node_count)])
    bridge = f"mtsb{tag}"
    with contextlib.ExitStack() as stack:
        try:
            _ip("link", "add", bridge, "type", "bridge")
            stack.callback(_ip_quiet, "link", "del", bridge)  # also removes the veth ends attached to it
            _ip("addr", "add", f"{net.controller}/{subnet.prefixlen}", "dev", bridge)
            _ip("link", "set", bridge, "up")
            for i, (namespace, address) in enumerate(zip(net.namespaces, net.node_addresses)):
                outside, inside = f"mtsv{tag}a{i}", f"mtsv{tag}b{i}"
                _ip("netns", "add", namespace)
                stack.callback(_ip_quiet, "netns", "del", namespace)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", namespace)
                _ip("link", "set", outside, "master", bridge, "up")
                _ip("-n", namespace, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", inside)
                _ip("-n", namespace, "link", "set", inside, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except (OSError, subprocess.SubprocessError) as exc:
            raise SlurmUnavailable(f"cannot build the nodes' network namespaces: {exc}") from None
        yield net


def _unused_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no interface or route of this machine touches."""
    taken = [ipaddress.ip_network(word, strict=False) for word in
             re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", subprocess.run(
                 ["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout + subprocess.run(
                 ["ip", "-4", "route"], capture_output=True, text=True).stdout)]
    for third in range(os.getpid() % 250, os.getpid() % 250 + 250):
        candidate = ipaddress.ip_network(f"10.213.{third % 250}.0/24")
        if not any(candidate.overlaps(other) for other in taken):
            return candidate
    raise SlurmUnavailable("no free /24 in 10.213.0.0/16 for the nodes' network")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if result.returncode:
        raise subprocess.SubprocessError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _ip_quiet(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, timeout=15)


@contextlib.contextmanager
def _munged(root: Path, cluster: SlurmCluster) -> Iterator[Path]:
    """munged with its own key, socket, pid, seed and log files; returns the socket."""
    munge, sockets = root / "munge", root / "munge-socket"  # munged wants its socket's folder open to all
    munge.mkdir(mode=0o700)
    sockets.mkdir(mode=0o755)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path, log = sockets / "munge.socket", munge / "munged.log"
    cluster.logs.append(log)
    command = ["munged", "--foreground", f"--socket={socket_path}", f"--key-file={key}",
               f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}", f"--log-file={log}"]
    with _daemon(command, cluster, "munged"):
        deadline = time.monotonic() + 15
        while not socket_path.exists():
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not open {socket_path} within 15 s:\n{_tail(log, 15)}")
            time.sleep(0.05)
        yield socket_path


def _write_config(root: Path, nodes: list[str], net: _Network, munge_socket: Path, ctld_port: int) -> Path:
    cpus = os.cpu_count() or 1
    node_lines = "".join(f"NodeName={node} NodeAddr={address} CPUs={cpus} State=UNKNOWN\n"
                         for node, address in zip(nodes, net.node_addresses))
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=meshtune
SlurmctldHost={socket.gethostname().split('.')[0]}({net.controller})
SlurmctldPort={ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s by default)
AuthInfo=socket={munge_socket},cred_expire=5
CredType=cred/munge
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'run'}/slurmctld.pid
SlurmdPidFile={root / 'run'}/slurmd-%n.pid
SlurmctldLogFile={root / 'log'}/slurmctld.log
SlurmdLogFile={root / 'log'}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# a requeued job becomes eligible at a set time, with no event to start it: look every second, not every minute
SchedulerParameters=sched_interval=1
ReturnToService=2
# a stopped job's processes get SIGTERM, then SIGKILL after KillWait: long enough for meshtune to save
KillWait=15
# a finished job stays visible to `scontrol show job` (there is no slurmdbd) this long
MinJobAge=120
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
Waittime=0
{node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    # read by slurmd even with no cgroup plugin in use; IgnoreSystemd: a cgroup v2 host without systemd
    (root / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
    return conf


@contextlib.contextmanager
def _daemon(command: list[str], cluster: SlurmCluster, name: str) -> Iterator[subprocess.Popen]:
    """A foreground daemon of this process; it must stay up, and is stopped by PID on the way out."""
    output = cluster.root / "log" / f"{name.replace(' ', '-')}.out"
    with output.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PATH": PATH, **cluster.env}, start_new_session=True)
    cluster.logs.append(output)
    try:
        time.sleep(0.3)
        if process.poll() is not None:
            raise SlurmUnavailable(f"{name} exited {process.returncode} at start:\n{cluster.log_tails()}")
        yield process
    finally:
        _stop(process)


def _stop(process: subprocess.Popen, grace: float = 5) -> None:
    """SIGTERM (the daemons save their state and leave), SIGKILL to its process tree after `grace` seconds, then
    to what is left of its process group (slurmctld's slurmscriptd outlives a slurmctld that failed to start)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # its own group: started with start_new_session


def _kill_namespace_processes(namespace: str, timeout: float = 10) -> None:
    """Every process still in a node's network namespace: it is one this cluster started (a job step). Waits
    until each has ended (a dying process leaves the namespace before it is gone)."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=15)
        pids = {int(pid) for pid in listed.stdout.split()}
        if not pids and not any(alive(pid) for pid in killed):
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _wait_for_port(address: str, port: int, timeout: float, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
            return
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"slurmctld did not listen on {address}:{port} within {timeout} s:\n"
                                   + cluster.log_tails())
        time.sleep(0.1)


def _wait_for_idle_nodes(cluster: SlurmCluster, timeout: float) -> None:
    deadline, states = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            states = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %t", timeout=10)
            if sorted(line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]) \
                    == sorted(cluster.nodes):
                return
        time.sleep(0.3)
    raise SlurmUnavailable(f"the nodes were not idle within {timeout} s (sinfo: {states.strip()!r}):\n"
                           + cluster.log_tails())
