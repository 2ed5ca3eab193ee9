"""`meshtune doctor cfg.yaml`: the checks users otherwise do by hand before a multi-node run, run with the same
command and environment on every node. The nodes meet in a key-value store of their own (torch's TCPStore, hosted
by node 0 on MASTER_ADDR:MASTER_PORT, released before training uses the port), each posts its facts
(`node_facts.py`), and node 0 prints one table: a row per check, a column per node, each cell ✔ / ✘ / ! with
the fix below. Every network step has a timeout: a node that never comes is named, not waited for.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from meshtune.launch.node_facts import collect_facts
from meshtune.launch.nodes import NodeSettings, node_range

OK, FAIL, WARN = "✔", "✘", "!"
CLOCK_WARN_S, CLOCK_FAIL_S = 2.0, 60.0
CHECKPOINT_BYTES_PER_PARAM = {"full": 12, "lora": 0, "qlora": 0}  # fp32 weights + two AdamW moments


@dataclass
class Row:
    check: str
    cells: dict[int, tuple[str, str]] = field(default_factory=dict)  # column -> (mark, text)
    fixes: list[str] = field(default_factory=list)

    def mark(self, column: int, mark: str, text: str, fix: str | None = None) -> None:
        self.cells[column] = (mark, text)
        if fix and fix not in self.fixes:
            self.fixes.append(fix)

    @property
    def failed(self) -> bool:
        return any(mark == FAIL for mark, _ in self.cells.values())


class DoctorStore:
    """Node 0 hosts the store; the others connect to it until `timeout_s` has passed."""

    def __init__(self, settings: NodeSettings, timeout_s: float):
        self.is_host = settings.node_rank == 0
        self.store = TCPStore(settings.master_addr, settings.master_port, None, self.is_host,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

    def post(self, facts: dict) -> int:
        index = self.store.add("joined", 1) - 1
        self.store.set(f"facts/{index}", json.dumps(facts))
        return index

    def joined(self) -> int:
        return self.store.add("joined", 0)

    def facts(self, index: int) -> dict:
        return json.loads(self.store.get(f"facts/{index}"))


def run_doctor(cfg, settings: NodeSettings, timeout_s: float = 30.0, out=print) -> tuple[int, dict]:
    """This node's part; node 0 returns the table as JSON too. Exit code 1 on any ✘."""
    expected = node_range(settings.nnodes)[1]
    if settings.master_port is None or expected == 1:
        return run_alone(cfg, settings, out)
    started = time.monotonic()
    try:
        store = DoctorStore(settings, timeout_s)
    except Exception as exc:  # noqa: BLE001 - bind or connect failures come as several exception types
        return unreachable(settings, timeout_s, exc, out)
    token = None
    if store.is_host:
        token = secrets.token_hex(8)
        write_token(cfg, token)
        store.store.set("token", token)
    facts = collect_facts(cfg, settings)
    if not store.is_host:
        token = store.store.get("token").decode()
    facts["output_dir"]["sees node 0's file"] = (Path(cfg.output_dir).expanduser() / f".meshtune-doctor-{token}").is_file()
    facts["posted_at"] = time.time()
    index = store.post(facts)
    if not store.is_host:
        return follow(store, settings, index, timeout_s, out)
    arrivals = {index: (facts, facts["posted_at"])}
    while len(arrivals) < expected and time.monotonic() - started < timeout_s:
        for i in range(store.joined()):
            if i not in arrivals:
                arrivals[i] = (store.facts(i), time.time())
        time.sleep(0.05)
    for i in range(store.joined()):
        if i not in arrivals:
            arrivals[i] = (store.facts(i), time.time())
    remove_token(cfg, token)
    report = evaluate(cfg, settings, [facts for facts, _ in arrivals.values()],
                      {i: arrival - facts["posted_at"] for i, (facts, arrival) in arrivals.items()}, timeout_s)
    text = render(report)
    out(text)
    code = 1 if report["failed"] else 0
    store.store.set("verdict", json.dumps({"code": code, "report": report}))
    deadline = time.monotonic() + 10
    while store.store.add("read", 0) < len(arrivals) - 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the others read the verdict before node 0's store goes away
    return code, report


def follow(store: DoctorStore, settings: NodeSettings, index: int, timeout_s: float, out) -> tuple[int, dict]:
    """A node other than 0: wait for node 0's verdict, print the rows that concern this node."""
    store.store.set_timeout(timedelta(seconds=timeout_s + 30))
    verdict = json.loads(store.store.get("verdict"))
    store.store.add("read", 1)
    report = verdict["report"]
    column = next((c for c in report["columns"] if c["index"] == index), None)
    mine = [row for row in report["rows"] if column and str(column["position"]) in row["cells"]
            and row["cells"][str(column["position"])][0] != OK]
    out(f"meshtune doctor, node {settings.node_rank}: node 0 printed the table; "
        + ("every check passed here" if not mine else f"{len(mine)} check(s) need attention here:"))
    for row in mine:
        mark, text = row["cells"][str(column["position"])]
        out(f"  {mark} {row['check']}: {text}")
        for fix in row["fixes"]:
            out(f"      fix: {fix}")
    return verdict["code"], report


def run_alone(cfg, settings: NodeSettings, out) -> tuple[int, dict]:
    facts = collect_facts(cfg, settings)
    facts["output_dir"]["sees node 0's file"] = True
    report = evaluate(cfg, settings, [facts], {0: 0.0}, 0)
    out(render(report))
    return (1 if report["failed"] else 0), report


def unreachable(settings: NodeSettings, timeout_s: float, exc: Exception, out) -> tuple[int, dict]:
    where = f"{settings.master_addr}:{settings.master_port}"
    if settings.node_rank == 0:
        text = (f"{FAIL} node 0 cannot host the doctor's store on {where}: {exc}\n"
                f"  fix: MASTER_PORT {settings.master_port} is in use (another job, or another node also started "
                f"with NODE_RANK 0) or MASTER_ADDR is not an address of this host; pick a free port (the same on "
                f"every node) and run node 0 on the MASTER_ADDR machine")
    else:
        text = (f"{FAIL} node {settings.node_rank} could not reach node 0 at {where} within {timeout_s:g} s: {exc}\n"
                f"  fix: start node 0 first with the same MASTER_ADDR / MASTER_PORT; check that {where} is node 0's "
                f"address and port (a firewall, or a MASTER_PORT that differs between nodes, also end here)")
    out(f"meshtune doctor, node {settings.node_rank}:\n{text}")
    return 1, {"failed": True, "rows": [], "columns": [], "message": text}


def write_token(cfg, token: str) -> None:
    path = Path(cfg.output_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / f".meshtune-doctor-{token}").write_text("written by node 0's meshtune doctor\n")
    except OSError:
        pass  # the output_dir row says it is not writable


def remove_token(cfg, token: str) -> None:
    (Path(cfg.output_dir).expanduser() / f".meshtune-doctor-{token}").unlink(missing_ok=True)


def evaluate(cfg, settings: NodeSettings, arrivals: list[dict], skew_of: dict[int, float], timeout_s: float) -> dict:
    """The rows of the table from every node's facts (node 0's first): which checks pass where."""
    nodes = sorted(range(len(arrivals)), key=lambda i: (arrivals[i]["node_rank"], i))
    columns = [{"position": p, "index": i, "node_rank": arrivals[i]["node_rank"], "host": arrivals[i]["host"]}
               for p, i in enumerate(nodes)]
    facts = [arrivals[i] for i in nodes]
    skews = [skew_of.get(i, 0.0) for i in nodes]
    reference = next((f for f in facts if f["node_rank"] == 0), facts[0])
    rows = [joined_row(facts, *node_range(settings.nnodes), timeout_s), launch_row(facts, reference),
            config_row(facts, reference), accelerator_row(facts, reference), software_row(facts, reference),
            files_row("model files", "model", "model_name_or_path", facts, reference),
            files_row("dataset files", "dataset", "dataset", facts, reference),
            output_row(cfg, facts), clock_row(facts, skews), network_row(facts)]
    return {"columns": columns, "failed": any(row.failed for row in rows),
            "rows": [{"check": row.check, "cells": {str(k): v for k, v in row.cells.items()}, "fixes": row.fixes}
                     for row in rows]}


def joined_row(facts: list[dict], fewest: int, expected: int, timeout_s: float) -> Row:
    """Every node rank joined once. An elastic job (`nnodes: MIN:MAX`) may start with MIN: the others missing
    is a note, not a failure."""
    row = Row("node joined, NODE_RANK")
    ranks = [f["node_rank"] for f in facts]
    for position, f in enumerate(facts):
        rank = f["node_rank"]
        if ranks.count(rank) > 1:
            others = [g["host"] for g in facts if g["node_rank"] == rank and g is not f]
            row.mark(position, FAIL, f"NODE_RANK {rank} also on {', '.join(others)}" + (
                " (same host)" if f["host"] in others else ""),
                     f"give each node its own NODE_RANK from 0 to NNODES-1 (NODE_RANK {rank} is used twice)")
        elif rank >= expected:
            row.mark(position, FAIL, f"NODE_RANK {rank} >= NNODES {expected}", "NODE_RANK must be below NNODES")
        else:
            row.mark(position, OK, f"rank {rank} of {expected}")
    missing = sorted(set(range(expected)) - set(ranks))
    if missing:
        fix = (f"node rank(s) {', '.join(map(str, missing))} did not join within {timeout_s:g} s: start "
               f"`meshtune doctor` there, with MASTER_ADDR / MASTER_PORT reaching node 0 (wrong port, firewall)")
        enough = len(set(ranks)) >= fewest and not any(rank < fewest for rank in missing)
        row.mark(0, WARN if enough else FAIL, f"missing node rank(s) {', '.join(map(str, missing))}", fix)
    return row


def launch_row(facts: list[dict], reference: dict) -> Row:
    row = Row("NNODES, MASTER_ADDR/PORT, processes")
    keys = ("nnodes", "master_addr", "master_port", "nproc_per_node")
    for position, f in enumerate(facts):
        differing = [k for k in keys if f[k] != reference[k]]
        text = f"{f['nnodes']} nodes, {f['master_addr']}:{f['master_port']}, {f['nproc_per_node']}/node"
        if differing:
            row.mark(position, FAIL, text, "set the same NNODES, MASTER_ADDR, MASTER_PORT and NPROC_PER_NODE on every "
                     f"node (node 0 has {', '.join(f'{k}={reference[k]}' for k in differing)})")
        else:
            row.mark(position, OK, text)
    return row


def config_row(facts: list[dict], reference: dict) -> Row:
    row = Row("config (keys all nodes share)")
    for position, f in enumerate(facts):
        differing = sorted(k.removeprefix("config key ") for k, v in f["config"].items()
                           if reference["config"].get(k) != v)
        if differing:
            row.mark(position, FAIL, f"differs: {', '.join(differing)}",
                     "run the same config and overrides on every node")
        else:
            row.mark(position, OK, "same as node 0")
    return row


def accelerator_row(facts: list[dict], reference: dict) -> Row:
    row = Row("GPUs, driver, CUDA, NCCL")
    for position, f in enumerate(facts):
        acc = f["accelerators"]
        if "error" in acc:
            row.mark(position, FAIL, acc["error"], None)
            continue
        if not acc["count"]:
            row.mark(position, OK, "none (CPU, gloo)")
            continue
        models = sorted(set(acc["models"]))
        text = f"{acc['count']}x {'/'.join(models)}, driver {acc['driver']}, CUDA {acc['cuda']}, NCCL {acc['nccl']}"
        if acc["count"] < f["nproc_per_node"]:
            row.mark(position, FAIL, text, f"a node has fewer GPUs than nproc_per_node ({f['nproc_per_node']}): "
                     f"lower NPROC_PER_NODE or check CUDA_VISIBLE_DEVICES")
        elif models != sorted(set(reference["accelerators"].get("models", []))) or len(models) > 1:
            row.mark(position, WARN, text, "GPU models differ: the job runs at the slowest card's speed and "
                     "parallel: auto plans for the smallest memory")
        elif any(acc[k] != reference["accelerators"].get(k) for k in ("driver", "cuda", "nccl")):
            row.mark(position, WARN, text, "driver, CUDA or NCCL versions differ between nodes: use one image")
        else:
            row.mark(position, OK, text)
    return row


def software_row(facts: list[dict], reference: dict) -> Row:
    row = Row("torch, transformers, peft, torchao, meshtune")
    for position, f in enumerate(facts):
        soft = f["software"]
        differing = [f"{k} {v} (node 0: {reference['software'].get(k)})" for k, v in soft.items()
                     if reference["software"].get(k) != v]
        if differing:
            row.mark(position, FAIL, "; ".join(differing), "install the same versions on every node (one image or "
                     "lock file); 'meshtune code' differs when the installed sources differ")
        else:
            row.mark(position, OK, f"torch {soft.get('torch')}, meshtune {soft.get('meshtune')}")
    return row


def files_row(title: str, key: str, config_key: str, facts: list[dict], reference: dict) -> Row:
    row = Row(title)
    for position, f in enumerate(facts):
        fact = f[key]
        if "error" in fact:
            row.mark(position, FAIL, fact["error"], f"{config_key}: make the files present on every node")
        elif fact["checksum"] != reference[key].get("checksum"):
            row.mark(position, FAIL, f"sha256 {fact['checksum'][:8]} (node 0: {reference[key].get('checksum', '')[:8]})",
                     f"{config_key}: the files differ from node 0's; put them on shared storage or copy node 0's")
        else:
            row.mark(position, OK, f"{fact['files']} file(s), sha256 {fact['checksum'][:8]}")
    return row


def output_row(cfg, facts: list[dict]) -> Row:
    row = Row("output_dir: writable, shared, space")
    need = checkpoint_bytes(cfg)
    for position, f in enumerate(facts):
        out = f["output_dir"]
        if not out.get("writable"):
            row.mark(position, FAIL, out.get("error", "not writable"), "output_dir must be writable on every node")
        elif not out.get("sees node 0's file"):
            row.mark(position, FAIL, "not the storage node 0 writes to", "output_dir must be one shared storage "
                     "(NFS, Lustre, ...) for all nodes, or set allow_local_checkpoints: true")
        elif need and out["free_bytes"] < need:
            row.mark(position, WARN, f"{out['free_bytes'] / 2**30:.0f} GiB free, ~{need / 2**30:.0f} GiB needed",
                     "free space or lower save_total_limit: the checkpoints kept may not fit")
        else:
            row.mark(position, OK, f"{out['free_bytes'] / 2**30:,.0f} GiB free" + (
                f" (~{need / 2**30:,.1f} GiB of checkpoints)" if need else ""))
    return row


def checkpoint_bytes(cfg) -> int:
    """Checkpoints kept (save_total_limit, else every save) for full fine-tuning: fp32 weights and two AdamW
    moments a parameter, from the model's safetensors size (bf16: 2 bytes a parameter). LoRA's are small."""
    per_param = CHECKPOINT_BYTES_PER_PARAM.get(cfg.finetuning_type, 0)
    if not per_param or not cfg.save_steps:
        return 0
    weights = sum(p.stat().st_size for p in Path(cfg.model_name_or_path).expanduser().glob("*.safetensors"))
    saves = cfg.save_total_limit or max(1, (cfg.max_steps or 1000) // cfg.save_steps)
    return int(weights / 2 * per_param * saves)


def clock_row(facts: list[dict], skews: list[float]) -> Row:
    row = Row("clock, against node 0")
    for position, (f, skew) in enumerate(zip(facts, skews)):
        text = f"{-skew:+.1f} s" if abs(skew) >= 0.05 else "within 0.1 s"
        if abs(skew) > CLOCK_FAIL_S:
            row.mark(position, FAIL, text, "synchronise the clocks (chrony / NTP): timeouts and logs go wrong")
        elif abs(skew) > CLOCK_WARN_S:
            row.mark(position, WARN, text, "synchronise the clocks (chrony / NTP)")
        else:
            row.mark(position, OK, text if position else "reference")
    return row


def network_row(facts: list[dict]) -> Row:
    row = Row("interface to MASTER_ADDR")
    for position, f in enumerate(facts):
        net = f["network"]
        if "error" in net:
            row.mark(position, FAIL, net["error"], "MASTER_ADDR must resolve on every node")
            continue
        route = net["route_interface"]
        ib = f", IB {','.join(net['infiniband'])}" if net["infiniband"] else ", no InfiniBand"
        text = f"{route} ({net['route_address']}){ib}"
        wrong = [(name, value) for name, value in (("NCCL_SOCKET_IFNAME", net["NCCL_SOCKET_IFNAME"]),
                                                    ("GLOO_SOCKET_IFNAME", net["GLOO_SOCKET_IFNAME"]))
                 if value and route and not value.startswith("^") and route not in value.split(",")]
        if wrong:
            row.mark(position, FAIL, text + "; " + ", ".join(f"{n}={v}" for n, v in wrong),
                     f"set NCCL_SOCKET_IFNAME={route} and GLOO_SOCKET_IFNAME={route} on node {f['node_rank']}: the "
                     f"interface set does not route to MASTER_ADDR")
        elif route and net["hostname_interface"] not in (None, route) and not net["GLOO_SOCKET_IFNAME"]:
            row.mark(position, WARN, text + f"; host name on {net['hostname_interface']}",
                     f"node {f['node_rank']}: the host name resolves to {net['hostname_interface']}, which gloo "
                     f"would use: set GLOO_SOCKET_IFNAME={route} NCCL_SOCKET_IFNAME={route}")
        else:
            row.mark(position, OK, text)
    return row


def render(report: dict) -> str:
    """One table (a column per node) and the fixes below it."""
    columns = report["columns"]
    header = ["check", *[f"node {c['node_rank']} ({c['host']})" for c in columns]]
    lines = [header]
    for row in report["rows"]:
        cells = [row["check"]]
        for c in columns:
            mark, text = row["cells"].get(str(c["position"]), (" ", ""))
            cells.append(f"{mark} {text[:44]}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    fixes = [f"  {row['check']}: {fix}" for row in report["rows"] for fix in row["fixes"]]
    verdict = ("✘ at least one check failed: fix the rows marked ✘ before training" if report["failed"] else
               "✔ every node is ready" + (" (see the ! rows)" if fixes else ""))
    return "\n".join(["meshtune doctor", *table, *(["fixes:", *fixes] if fixes else []), verdict])
