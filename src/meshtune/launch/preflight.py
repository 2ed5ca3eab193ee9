"""The doctor as the first step of a multi-node launch (config key `preflight`): the nodes meet on
MASTER_ADDR:MASTER_PORT before torchrun does, run every check of `meshtune doctor` (with `preflight: bandwidth`
the bandwidth test too), and stop before anything trains when one fails, with node 0's table.

Only a launch of the whole job runs it. Node 0 relaunched into its running job (it took over the job's own
output_dir lock) and a node whose MASTER_PORT answers with a running job's rendezvous store (a node relaunched
into a job, or one joining an elastic job late) skip it: the other nodes are in torchrun and would never come.
Node 0 also gives up its preflight as soon as a node shows up in torchrun's rendezvous instead. The other nodes'
rejoin after a lost store (supervise.rejoin_after_store_loss) never runs it. A node whose node 0 went away during
the checks waits for it again (within rdzv_timeout) and starts over: node 0, relaunched, holds its checks again, or
(rejoining its job) goes straight into torchrun's rendezvous, which the next try skips the checks for.
"""

from __future__ import annotations

import logging
import time

from meshtune.doctor.bandwidth import duration_text
from meshtune.doctor.checks import FAIL, OK
from meshtune.doctor.meeting import run_doctor
from meshtune.doctor.reachability import reach_node0
from meshtune.errors import MeshtuneError
from meshtune.launch.nodes import NodeSettings


logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1.0  # after node 0's checks' store went away, before this node looks for node 0 again


class PreflightError(MeshtuneError):
    """A check across the nodes failed: no torchrun was started."""


def run_preflight(cfg, settings: NodeSettings, rejoining: bool) -> None:
    """This node's part of the preflight, or a line saying why it is skipped; PreflightError on a failed check."""
    if not cfg.preflight or not settings.multi_node:
        return
    if cfg.rdzv_backend != "c10d":
        logger.info("preflight: skipped with rdzv_backend etcd-v2 (no store of node 0 on MASTER_PORT tells a node "
                    "joining a running job from one waiting for node 0): run `meshtune doctor cfg.yaml` on every node "
                    "instead")
        return
    if rejoining:
        logger.info("preflight: skipped: node 0 rejoins its running job (it took over the job's own output_dir lock); "
                    "the other nodes wait in torchrun's rendezvous")
        return
    started = time.monotonic()
    while True:
        reach_node0(settings, cfg.rdzv_timeout, prefix="preflight: ")
        lines: list[str] = []
        try:
            code, report = run_doctor(cfg, settings, cfg.rdzv_timeout, out=lines.append,
                                      bandwidth=cfg.preflight == "bandwidth",
                                      progress=lambda line: logger.info(f"preflight: {line}"))
            break
        except MeshtuneError as exc:  # a node that cannot join said why (doctor/joining.py's refusal)
            raise PreflightError(f"preflight: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the store went away mid-way: the TCPStore's error types vary
            where = f"{settings.master_addr}:{settings.master_port}"
            if settings.node_rank == 0 or time.monotonic() - started > cfg.rdzv_timeout:
                raise PreflightError(f"preflight: node {settings.node_rank} lost the checks' store at {where} (node "
                                     f"0 stopped or died): {type(exc).__name__}: {exc}. Launch the job again on every "
                                     f"node, or set preflight: false to skip these checks") from None
            # node 0 relaunched comes back with its checks, or (rejoining its job) straight into torchrun's
            # rendezvous, which the next try meets and skips the checks for
            logger.warning(f"preflight: node {settings.node_rank} lost the checks' store at {where} (node 0 stopped "
                           f"or died); waiting for node 0 again (up to rdzv_timeout={cfg.rdzv_timeout} s)")
            time.sleep(RETRY_AFTER_S)
    took = time.monotonic() - started
    if "skipped" in report:
        logger.info(f"preflight: skipped: {report['skipped']}")
        return
    if report.get("late") and not code:
        logger.info(f"preflight: node {settings.node_rank} joined after node 0 closed its checks (an elastic job "
                    f"above its minimum): not checked")
        return
    needs_look = report["mine"] if "mine" in report else [
        row for row in report.get("rows", []) if any(mark != OK for mark, _ in row["cells"].values())]
    if code or needs_look:
        logger.warning("\n".join(lines))  # the table: what failed or needs a look
    if code:
        raise PreflightError(failure(settings, cfg.rdzv_timeout, report))
    if not needs_look:
        logger.info(f"preflight: {len(report['columns'])} nodes, all checks passed{measured(report)} ({took:.1f} s)")


def failure(settings: NodeSettings, timeout_s: float, report: dict) -> str:
    failed = [row["check"] for row in report.get("rows", []) if any(m == FAIL for m, _ in row["cells"].values())]
    if not failed:  # this node could not meet the others: the doctor's own message says why
        return f"preflight: node {settings.node_rank}: {report.get('message', 'the checks did not run')}"
    where = ("the table above names each node and the fix" if settings.node_rank == 0 else
             "node 0 printed the table; the rows for this node are above")
    return (f"preflight: {cause(report, timeout_s)}{len(failed)} check(s) failed across the nodes "
            f"({', '.join(failed)}); {where}. Nothing was started: fix them and launch again on every node, or set "
            f"preflight: false to skip these checks")


def cause(report: dict, timeout_s: float) -> str:
    """What node 0's table found that keeps the nodes from forming one job, first on every node's last line:
    settings that differ, a NODE_RANK given twice, else the node ranks node 0 waited for in vain."""
    said = [f"{key.upper()} differs between nodes ({', '.join(f'node {rank}: {value}' for rank, value in by.items())})"
            for key, by in report.get("launch_differences", {}).items()]
    said += [f"NODE_RANK {rank} was given to more than one node" for rank in report.get("duplicate_ranks", [])]
    if not said and report.get("missing"):
        said = [f"node rank(s) {', '.join(map(str, report['missing']))} never joined within rdzv_timeout="
                f"{timeout_s:g} s"]
    return "".join(f"{line}; " for line in said)


def measured(report: dict) -> str:
    """The bandwidth in the one-line summary, when it was measured."""
    result = (report.get("bandwidth") or {}).get("result") or {}
    if "all_reduce" not in result:
        return ""
    text = (f"; all-reduce {result['all_reduce'][-1]['busbw'] / 1e9:.3g} GB/s busbw, latency "
            f"{duration_text(result['all_reduce'][0]['seconds'])}")
    traffic = report["bandwidth"].get("traffic") or {}
    if "comm_s" in traffic:
        text += f"; ~{duration_text(traffic['comm_s'])} of communication a step under {traffic['parallel']}"
    return text
