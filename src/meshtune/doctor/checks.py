"""The doctor's table: from every node's facts (and, with --bandwidth, the measured link), a row per check with a
cell per node (✔ / ✘ / !) and the fixes below it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from meshtune.doctor.bandwidth import duration_text
from meshtune.doctor.launch_settings import LaunchSettings
from meshtune.package_clash import peft_torchao_clash
from meshtune.train.agreement import Difference, differences
from meshtune.units import byte_size

OK, FAIL, WARN = "✔", "✘", "!"
CLOCK_WARN_S, CLOCK_FAIL_S = 2.0, 60.0
CHECKPOINT_BYTES_PER_PARAM = {"full": 12, "lora": 0, "qlora": 0}  # fp32 weights + two AdamW moments
BF16_MASTER_CHECKPOINT_BYTES_PER_PARAM = 6  # master_weights: bf16: bf16 weights + two bf16 moments
SLOW_PAIR = 0.5  # a pair below half the median pair's bandwidth is a slow link


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


def evaluate(cfg, settings: LaunchSettings, arrivals: dict[int, dict], skew_of: dict[int, float], timeout_s: float,
             bandwidth: dict | None = None) -> dict:
    """The rows of the table from every node's facts, keyed by the order they joined in: which checks pass where.
    Columns go by node rank."""
    nodes = sorted(arrivals, key=lambda i: (arrivals[i]["node_rank"], i))
    columns = [{"position": p, "index": i, "node_rank": arrivals[i]["node_rank"], "host": arrivals[i]["host"]}
               for p, i in enumerate(nodes)]
    facts = [arrivals[i] for i in nodes]
    skews = [skew_of.get(i, 0.0) for i in nodes]
    reference = next((f for f in facts if f["node_rank"] == 0), facts[0])
    rows = [joined_row(facts, settings.min_nodes, settings.max_nodes, timeout_s), launch_row(facts, reference),
            config_row(facts, reference), accelerator_row(facts, reference), software_row(facts, reference),
            files_row("model files", "model", "model_name_or_path", facts, reference),
            files_row("dataset files", "dataset", "dataset", facts, reference),
            output_row(cfg, facts), *store_row(facts), clock_row(facts, skews), network_row(facts)]
    if bandwidth is not None:
        rows += bandwidth_rows(bandwidth, {i: p for p, i in enumerate(nodes)}, facts)
    ranks = [f["node_rank"] for f in facts]
    report = {"columns": columns, "failed": any(row.failed for row in rows),
              # node 0's view, for every node's last line: the ranks it waited for in vain, what nodes disagree on
              "missing": [rank for rank in range(settings.min_nodes) if rank not in ranks],
              "duplicate_ranks": sorted({rank for rank in ranks if ranks.count(rank) > 1}),
              "launch_differences": {key: {str(f["node_rank"]): f[key] for f in facts}
                                     for key in ("nnodes", "master_port") if len({f[key] for f in facts}) > 1},
              "rows": [{"check": row.check, "cells": {str(k): v for k, v in row.cells.items()}, "fixes": row.fixes}
                       for row in rows]}
    if bandwidth is not None:
        report["bandwidth"] = bandwidth
    return report


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
    if missing and len({f.get("nnodes") for f in facts}) > 1:  # node 0 stopped waiting: the nodes disagree on NNODES
        fix = (f"node rank(s) {', '.join(map(str, missing))} are missing by node 0's NNODES, which the nodes do not "
               f"agree on (the NNODES row): set the same NNODES on every node")
    elif missing:
        fix = (f"node rank(s) {', '.join(map(str, missing))} did not join within {timeout_s:g} s: start the same "
               f"command there (`meshtune doctor`, or `meshtune train` whose preflight runs these checks), with "
               f"MASTER_ADDR / MASTER_PORT reaching node 0 (wrong port, firewall)")
    if missing:
        enough = len(set(ranks)) >= fewest and not any(rank < fewest for rank in missing)
        row.mark(0, WARN if enough else FAIL, f"missing node rank(s) {', '.join(map(str, missing))}", fix)
    return row


def launch_row(facts: list[dict], reference: dict) -> Row:
    row = Row("NNODES, MASTER_ADDR/PORT, processes")
    keys = ("nnodes", "master_addr", "master_port", "nproc_per_node")
    for position, f in enumerate(facts):
        differing = [k for k in keys if f[k] != reference[k]]
        nodes = f"{f['nnodes']} node" + ("s" if str(f["nnodes"]) != "1" else "")
        port = (f"{f['master_addr']}:{f['master_port']}" if f["master_port"] else
                f"{f['master_addr']} (no port: one node)")
        text = f"{nodes}, {port}, {f['nproc_per_node']}/node"
        if differing:
            row.mark(position, FAIL, text, "set the same NNODES, MASTER_ADDR, MASTER_PORT and NPROC_PER_NODE on every "
                     f"node (node 0 has {', '.join(f'{k}={reference[k]}' for k in differing)})")
        else:
            row.mark(position, OK, text)
    return row


def config_row(facts: list[dict], reference: dict) -> Row:
    """The keys training's agreement check compares (`shared_config`), with its words: each key that differs
    is named with every node's value."""
    row = Row("config (keys all nodes share)")
    found = compared(facts, reference, "config")
    for position, f in enumerate(facts):
        keys = [d.key for d in found if position in d.differing]
        if keys:
            row.mark(position, FAIL, f"differs: {', '.join(k.removeprefix('config key ') for k in keys)}")
        else:
            row.mark(position, OK, "same as node 0")
    row.fixes += [f"{difference}. Run the same config and overrides on every node" for difference in found]
    return row


def compared(facts: list[dict], reference: dict, key: str) -> list[Difference]:
    """The nodes' `key` facts that differ (`differences`, as training's agreement check finds them), against the
    reference node's; `Difference.differing` holds column positions."""
    labelled = [(f"node {f['node_rank']} ({f['host']})", f[key]) for f in facts]
    return differences(labelled, reference=next(i for i, f in enumerate(facts) if f is reference))


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
    found = compared(facts, reference, "software")
    for position, f in enumerate(facts):
        soft = f["software"]
        differing = [f"{d.key} {soft[d.key]} (node 0: {d.reference})" for d in found if position in d.differing]
        clash = peft_torchao_clash(soft.get("peft"), soft.get("torchao"))
        if differing:
            row.mark(position, FAIL, "; ".join(differing), "install the same versions on every node (one image or "
                     "lock file); 'meshtune code' differs when the installed sources differ")
        elif clash:
            row.mark(position, FAIL, f"peft {soft.get('peft')}, torchao {soft.get('torchao')}", clash)
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
            row.mark(position, FAIL,
                     f"sha256 {fact['checksum'][:8]} (node 0: {reference[key].get('checksum', '')[:8]})",
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
        elif not out.get("sees node 0's file") and (f.get("checkpoint_store") or {}).get("url"):
            row.mark(position, OK, f"node-local, {out['free_bytes'] / 2**30:,.0f} GiB free (checkpoints go to "
                     f"{f['checkpoint_store']['url']})")
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


def store_row(facts: list[dict]) -> list[Row]:
    """checkpoint_dir in an object store: each node listed, wrote, read back and deleted a probe object there.
    No row where checkpoint_dir is no URL."""
    from meshtune.checkpoint.object_store import credentials_hint

    stores = [f.get("checkpoint_store") for f in facts]
    if not any(stores):
        return []
    row = Row("checkpoint_dir: the store lists, writes, reads, deletes")
    for position, store in enumerate(stores):
        if not store or "problem" not in store:
            row.mark(position, FAIL, (store or {}).get("error", "not checked"), "run the doctor with the same config "
                     "on every node")
        elif store["problem"]:
            row.mark(position, FAIL, store["problem"].replace(f" under {store['url']}", ""),
                     f"{store['problem']}: give every node credentials for the store and its endpoint "
                     f"({credentials_hint(store['url'])}); the bucket must exist")
        else:
            row.mark(position, OK, "probe object written, read back, deleted")
    return [row]


def checkpoint_bytes(cfg) -> int:
    """Checkpoints kept (save_total_limit, else every save) for full fine-tuning: fp32 weights and two AdamW
    moments a parameter (all three in bf16 with `master_weights: bf16`), from the model's safetensors size (bf16: 2
    bytes a parameter). LoRA's are small. With save_strategy epoch, one save an epoch."""
    per_param = CHECKPOINT_BYTES_PER_PARAM.get(cfg.finetuning_type, 0)
    if per_param and cfg.master_weights == "bf16":
        per_param = BF16_MASTER_CHECKPOINT_BYTES_PER_PARAM
    by_steps = cfg.save_strategy == "steps" and cfg.save_steps
    if not per_param or not (by_steps or cfg.save_strategy == "epoch"):
        return 0
    weights = sum(p.stat().st_size for p in Path(cfg.model_name_or_path).expanduser().glob("*.safetensors"))
    every_save = max(1, (cfg.max_steps or 1000) // cfg.save_steps) if by_steps else math.ceil(cfg.num_train_epochs)
    saves = cfg.save_total_limit or every_save
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


def bandwidth_rows(bandwidth: dict, position_of: dict[int, int], facts: list[dict]) -> list[Row]:
    """all-reduce bus bandwidth, latency, slowest pair and the verdict for the config's parallel mode: a cell for
    each node that took part (`bandwidth["members"]`: their join indices, in rank order), a note for the others."""
    names = ("all-reduce bus bandwidth", "latency", "slowest pair", f"verdict for {verdict_mode(bandwidth)}")
    rows = [Row(name) for name in names]
    members = [i for i in bandwidth.get("members", []) if i in position_of]
    positions = [position_of[i] for i in members]
    for position in range(len(facts)):
        if position not in positions:
            for row in rows:
                row.mark(position, WARN, "not measured", "run `meshtune doctor --bandwidth` on every node: a node "
                         "without it (or one that joined late) takes no part in the measurement")
    result = bandwidth.get("result") or {}
    if "error" in result or not members:
        failed = "error" in result
        why = result.get("error") or bandwidth.get("note", "fewer than 2 nodes to measure between")
        fix = (f"the nodes could not run a collective together, nor would training's: check the interface rows "
               f"(NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) and that no firewall blocks the nodes from each other on "
               f"any port (gloo and NCCL connect on ports other than MASTER_PORT); node 0's error: {why}"
               if failed else why)
        for i, position in zip(members, positions):
            text = bandwidth.get("errors", {}).get(str(i), why)
            for row in rows:
                row.mark(position, FAIL if failed else WARN, text, fix)
        return rows
    largest, smallest = result["all_reduce"][-1], result["all_reduce"][0]
    for position in positions:
        rows[0].mark(position, OK, f"{largest['busbw'] / 1e9:.3g} GB/s at {byte_size(largest['bytes'])}, "
                                   f"{result['backend']}")
        rows[1].mark(position, OK, f"{duration_text(smallest['seconds'])} ({byte_size(smallest['bytes'])} "
                                   f"all-reduce)")
    pair_row(rows[2], result["pairs"], positions, facts)
    verdict_row(rows[3], bandwidth.get("traffic") or {}, positions)
    return rows


def verdict_mode(bandwidth: dict) -> str:
    traffic = bandwidth.get("traffic") or {}
    if "parallel" not in traffic:
        return "this config"
    return traffic["parallel"] + (" (auto)" if traffic.get("auto") else "")


def pair_row(row: Row, pairs: list[dict], position_of_rank: list[int], facts: list[dict]) -> None:
    """Each node's slowest pair; a pair far below the others' median is a slow link, named with both hosts."""
    if not pairs:
        return
    speeds = sorted(p["bandwidth"] for p in pairs)
    median = speeds[len(speeds) // 2]
    for rank, position in enumerate(position_of_rank):
        mine = [p for p in pairs if rank in (p["a"], p["b"])]
        if not mine:
            row.mark(position, OK, "no pair measured")
            continue
        worst = min(mine, key=lambda p: p["bandwidth"])
        other = facts[position_of_rank[worst["b"] if worst["a"] == rank else worst["a"]]]
        text = f"to node {other['node_rank']}: {worst['bandwidth'] / 1e9:.3g} GB/s"
        if len(pairs) > 1 and worst["bandwidth"] < SLOW_PAIR * median:
            a, b = facts[position_of_rank[worst["a"]]], facts[position_of_rank[worst["b"]]]
            row.mark(position, WARN, text, f"the link between node {a['node_rank']} ({a['host']}) and node "
                     f"{b['node_rank']} ({b['host']}) carries {worst['bandwidth'] / 1e9:.3g} GB/s, the pairs' median "
                     f"{median / 1e9:.3g} GB/s: every collective runs at its speed. Check that link's network cards, "
                     f"cables and switch ports (ibstat, ethtool), or leave one of the two nodes out")
        else:
            row.mark(position, OK, text)


def verdict_row(row: Row, traffic: dict, members: list[int]) -> None:
    for position in members:
        if "error" in traffic:
            row.mark(position, WARN, traffic["error"][:60], f"no estimate of the traffic a step: {traffic['error']}")
        elif traffic.get("ratio") is None:
            row.mark(position, OK, f"~{duration_text(traffic['comm_s'])} comm a step (no GPU)")
        else:
            text = f"~{duration_text(traffic['comm_s'])} comm a step, {traffic['ratio']:.2g}x compute"
            row.mark(position, WARN if traffic["slow"] else OK, text, traffic["advice"])


def render(report: dict) -> str:
    """One table (a column per node), the bandwidth measured (with --bandwidth) and the fixes below it."""
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
    measured = render_bandwidth(report.get("bandwidth") or {}, columns)
    return "\n".join(["meshtune doctor", *table, *measured, *(["fixes:", *fixes] if fixes else []), verdict])


def render_bandwidth(bandwidth: dict, columns: list[dict]) -> list[str]:
    """The all-reduce sizes as nccl-tests prints them, the pairs, and the traffic of a step."""
    result = bandwidth.get("result") or {}
    if "all_reduce" not in result:
        return []
    node_of = {c["index"]: c["node_rank"] for c in columns}
    ranks = [node_of.get(i, "?") for i in bandwidth["members"]]
    lines = [f"all-reduce over {result['ranks']} nodes, one process a node ({result['backend']}, "
             f"{result['device']}):", f"  {'size':>9} {'time':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in result["all_reduce"]:
        lines.append(f"  {byte_size(r['bytes']):>9} {duration_text(r['seconds']):>10} {r['algbw'] / 1e9:>11.3f} "
                     f"{r['busbw'] / 1e9:>11.3f}")
    if result["pairs"]:
        each = byte_size(result["pairs"][0]["bytes"])
        scope = "every pair" if result["every_pair"] else f"{result['rounds']} rounds of pairs"
        lines.append(f"pairs ({scope}, {each} each way at once): " + ", ".join(
            f"node {ranks[p['a']]} <-> node {ranks[p['b']]} {p['bandwidth'] / 1e9:.3g} GB/s" for p in result["pairs"]))
    traffic = bandwidth.get("traffic") or {}
    if "text" in traffic:
        lines.append(f"per optimizer step: {traffic['text']}")
    return lines
