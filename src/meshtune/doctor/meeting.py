"""`meshtune doctor cfg.yaml`: the checks users otherwise do by hand before a multi-node run, run with the same
command and environment on every node, and by `meshtune train` itself before torchrun (launch/preflight.py).

The nodes meet in a key-value store of their own (torch's TCPStore, hosted by node 0 on MASTER_ADDR:MASTER_PORT and
marked as the doctor's, released before training uses the port), each posts its facts (`facts.py`), node 0
measures each node's clock against its own as the node joins, and prints one table (`checks.py`): a row per
check, a column per node, each cell ✔ / ✘ / ! with the fix below it. With --bandwidth, the nodes then measure the
link between them (`bandwidth.py`) and node 0 judges it against what the config moves a step (`traffic.py`).

Every network step has a timeout: a node that never comes is named, not waited for. Hashing a node's files (once:
checksums are cached) happens before that node posts and does not count against the others' wait.
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from meshtune.doctor.bandwidth import DEADLINE_S, Measurement
from meshtune.doctor.checks import FAIL, OK, evaluate, render
from meshtune.doctor.facts import collect_facts
from meshtune.doctor.joining import join_key, refusal_key
from meshtune.doctor.launch_settings import LaunchSettings
from meshtune.doctor.reachability import NotAStore, RendezvousError, check_port_free, wait_for_master

DOCTOR_KEY = "meshtune-doctor"  # set by node 0 as it opens the store: a store without it is not the doctor's
MARK_WAIT_S = 3.0        # how long a node looks for that mark before deciding the port holds another store
NODE0_FACTS_WAIT_S = 3600.0  # node 0 may be hashing a large model the first time; its death ends the wait at once
ELASTIC_GRACE_S = 30.0   # once an elastic job's MIN nodes are there, the others get this long (torchrun's last call)
MISCONFIGURED_GRACE_S = 5.0  # once the facts fail the table whoever comes, the nodes started with them get this long
PROGRESS_S = 15.0        # a line while node 0 waits (three within a shorter timeout)
PONG_WAIT_S = 10.0
READ_WAIT_S = 10.0


class DoctorStore:
    """Node 0 hosts the store and marks it; the others connect to it until `timeout_s` has passed."""

    def __init__(self, settings: LaunchSettings, timeout_s: float):
        self.is_host = settings.node_rank == 0
        self.store = TCPStore(settings.master_addr, settings.master_port, None, self.is_host,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        if self.is_host:
            self.store.set(DOCTOR_KEY, settings.run_id)

    def is_doctor(self) -> bool:
        """The store answering is node 0's doctor, not a running job's rendezvous store (or another service)."""
        deadline = time.monotonic() + MARK_WAIT_S
        while not self.store.check([DOCTOR_KEY]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def post(self, facts: dict) -> int:
        index = self.store.add("joined", 1) - 1
        self.store.set(f"facts/{index}", json.dumps(facts))
        return index

    def joined(self) -> int:
        return self.store.add("joined", 0)

    def facts(self, index: int) -> dict:
        return json.loads(self.store.get(f"facts/{index}"))

    def put(self, key: str, value: dict) -> None:
        self.store.set(key, json.dumps(value))

    def take(self, key: str, timeout_s: float) -> dict:
        self.store.set_timeout(timedelta(seconds=timeout_s))
        return json.loads(self.store.get(key))

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def close(self) -> None:
        """Drop the store: on node 0 its port is free for torchrun's rendezvous once this returns."""
        self.store = None


def run_doctor(cfg, settings: LaunchSettings, timeout_s: float = 30.0, out=print, bandwidth: bool = False,
               progress=None) -> tuple[int, dict]:
    """This node's part; node 0 returns the table as JSON too. Exit code 1 on any ✘. A report with `skipped` says
    why nothing was checked (the port holds a running job's store; a node of the job is already in its rendezvous).
    `progress` gets a line every PROGRESS_S while node 0 waits for the others."""
    expected = settings.max_nodes
    if settings.master_port is None or expected == 1:
        return run_alone(cfg, settings, out, bandwidth)
    started = time.monotonic()
    if settings.node_rank == 0:
        try:
            check_port_free(settings)  # an address that does not resolve, a port another program holds
        except RendezvousError as exc:
            out(f"meshtune doctor, node 0:\n{FAIL} {exc}")
            return 1, {"failed": True, "rows": [], "columns": [], "message": str(exc)}
    else:
        # a plain connect first: TCPStore's own connect gives up only after a second full timeout (and a backoff
        # of up to as long) in between, which doubled the wait on a wrong MASTER_PORT
        try:
            wait_for_master(settings, timeout_s, poll_s=0.5)
        except NotAStore as exc:
            out(f"meshtune doctor, node {settings.node_rank}:\n{FAIL} {exc}")
            return 1, {"failed": True, "rows": [], "columns": [], "message": str(exc)}
        except RendezvousError as exc:
            return unreachable(settings, timeout_s, exc.last_error, out)
    try:
        store = DoctorStore(settings, max(timeout_s - (time.monotonic() - started), MARK_WAIT_S))
    except Exception as exc:  # noqa: BLE001 - bind or connect failures come as several exception types
        return unreachable(settings, timeout_s, exc, out)
    try:
        if store.is_host:
            return host(cfg, settings, store, timeout_s, bandwidth, out, progress or out)
        if not store.is_doctor():
            where = f"{settings.master_addr}:{settings.master_port}"
            return 1, {"skipped": f"{where} answers, but not as node 0's doctor: it holds the rendezvous store of a "
                                  f"job already running (this node joins it late), or another service"}
        return join(cfg, settings, store, timeout_s, bandwidth, out)
    finally:
        store.close()


def this_node(cfg, settings: LaunchSettings, token: str, bandwidth: bool) -> dict:
    facts = collect_facts(cfg, settings)
    token_file = Path(cfg.output_dir).expanduser() / f".meshtune-doctor-{token}"
    facts["output_dir"]["sees node 0's file"] = token_file.is_file()
    facts["bandwidth"] = bandwidth
    return facts


def host(cfg, settings: LaunchSettings, store: DoctorStore, timeout_s: float, bandwidth: bool, out,
         progress) -> tuple[int, dict]:
    """Node 0: its facts, the others' as they come, the bandwidth, the table; the verdict posted for the others."""
    token = secrets.token_hex(8)
    write_token(cfg, token)
    store.store.set("token", token)
    try:
        facts = this_node(cfg, settings, token, bandwidth)
        index = store.post(facts)
        arrivals, skews, training = gather(store, settings, index, facts, timeout_s, progress)
    except RendezvousError as refused:  # a node that cannot join said why: the nodes that came stop with it too
        finish(store, {"code": 1, "message": str(refused)}, store.joined())
        raise
    finally:
        remove_token(cfg, token)
    if training is not None:
        store.put("bandwidth/plan", {"members": []})
        reason = (f"node {training} is already in torchrun's rendezvous on this port: a node rejoining a running job, "
                  f"or one started with preflight: false")
        return finish(store, {"code": 0, "skipped": reason}, len(arrivals))
    try:
        by_rank = sorted(arrivals, key=lambda i: (arrivals[i]["node_rank"], i))
        members = [i for i in by_rank if arrivals[i].get("bandwidth")] if bandwidth else []
        members = members if len(members) > 1 else []
        backend = "nccl" if members and all(arrivals[i]["accelerators"].get("count") for i in members) else "gloo"
        plan = {"members": members, "backend": backend, "prefix": f"bandwidth/{secrets.token_hex(4)}"}
        store.put("bandwidth/plan", plan)
        measured = host_bandwidth(cfg, settings, store, arrivals, plan, index) if bandwidth else None
        report = evaluate(cfg, settings, arrivals, skews, timeout_s, measured)
        out(render(report))
    except Exception as exc:  # the others would otherwise wait out their timeout for a verdict that never comes
        finish(store, {"code": 1, "message": f"node 0 could not finish the checks ({type(exc).__name__}: {exc}); "
                                             f"its own output says more"}, len(arrivals))
        raise
    return finish(store, {"code": 1 if report["failed"] else 0, "report": report}, len(arrivals))


def gather(store: DoctorStore, settings: LaunchSettings, index: int, facts: dict, timeout_s: float, progress):
    """The other nodes' facts as they come, each node's clock measured against node 0's as it joins. Until every
    node rank is there, `timeout_s` has passed, or (elastic) ELASTIC_GRACE_S after the minimum joined. The third
    value is a node rank found already in torchrun's rendezvous in this store, when one is (None otherwise)."""
    fewest, expected = settings.min_nodes, settings.max_nodes
    arrivals, skews = {index: facts}, {index: 0.0}
    started = reported = time.monotonic()
    enough = wrong = None
    polls = 0
    while True:
        for i in range(store.joined()):
            if i not in arrivals:
                arrivals[i] = store.facts(i)
                skews[i] = clock_skew(store, i)
        if store.has(refusal_key(settings.run_id)):  # a node that cannot join said why
            raise RendezvousError(store.store.get(refusal_key(settings.run_id)).decode())
        now = time.monotonic()
        if len(arrivals) >= expected:
            return arrivals, skews, None
        if wrong is None and misconfigured(arrivals):
            wrong = now
        if wrong is not None and now - wrong >= min(MISCONFIGURED_GRACE_S, timeout_s):
            return arrivals, skews, None
        if enough is None and len(arrivals) >= fewest:
            enough = now
        if now - started >= timeout_s or (enough is not None and now - enough >= min(ELASTIC_GRACE_S, timeout_s)):
            return arrivals, skews, None
        polls += 1
        if polls % 10 == 0 and (rank := node_in_rendezvous(store, settings)) is not None:
            return arrivals, skews, rank
        if now - reported >= min(PROGRESS_S, max(1.0, timeout_s / 3)):
            reported = now
            progress(joining_line(settings, arrivals, now - started, timeout_s))
        time.sleep(0.05)


def misconfigured(arrivals: dict) -> bool:
    """Facts that fail the table whoever else comes: two nodes with one NODE_RANK, or another NNODES than node
    0's. The table is printed MISCONFIGURED_GRACE_S later: waiting rdzv_timeout for the rest would only delay
    what it says."""
    ranks = [f["node_rank"] for f in arrivals.values()]
    return len(set(ranks)) < len(ranks) or len({f["nnodes"] for f in arrivals.values()}) > 1


def joining_line(settings: LaunchSettings, arrivals: dict, waited_s: float, timeout_s: float) -> str:
    ranks = sorted({f["node_rank"] for f in arrivals.values()})
    fewest, expected = settings.min_nodes, settings.max_nodes
    missing = [r for r in range(expected) if r not in ranks]
    need = f"at least {fewest} of {expected}" if fewest != expected else str(expected)
    return (f"{len(arrivals)} of {need} nodes joined (node ranks {', '.join(map(str, ranks))}); waiting for node "
            f"ranks {', '.join(map(str, missing))} ({waited_s:.0f} s of {timeout_s:g} s)")


def node_in_rendezvous(store: DoctorStore, settings: LaunchSettings) -> int | None:
    """A launcher in torchrun's rendezvous leaves its node rank in the store on MASTER_PORT (joining.py):
    found in the doctor's store, that node runs no doctor and will not come."""
    return next((rank for rank in range(settings.max_nodes) if store.has(join_key(settings.run_id, rank))), None)


def clock_skew(store: DoctorStore, index: int) -> float:
    """Node 0's clock minus the node's, from one round trip (the node answers with its time at once)."""
    sent = time.time()
    store.store.set(f"clock/ping/{index}", "")
    try:
        store.store.set_timeout(timedelta(seconds=PONG_WAIT_S))
        theirs = float(store.store.get(f"clock/pong/{index}"))
    except Exception:  # noqa: BLE001 - the node left after posting: its clock is not known
        return 0.0
    return (sent + time.time()) / 2 - theirs


def host_bandwidth(cfg, settings: LaunchSettings, store: DoctorStore, arrivals: dict, plan: dict, index: int) -> dict:
    """Node 0's part of the measurement; the model is sized while the child process measures."""
    members = plan["members"]
    if not members:
        return {"members": [], "note": "fewer than 2 nodes ran --bandwidth: nothing to measure between"}
    from meshtune.plan import link_applies

    # the matmul rate a step's compute is estimated from: a GPU's always, a CPU process's where the plan chooses
    # the mode by link_gbps from it
    peak = plan["backend"] == "nccl" or link_applies(cfg, len(members))
    measurement = Measurement(settings.master_addr, settings.master_port, plan["prefix"], members.index(index),
                              len(members), plan["backend"], peak=peak,
                              processes_a_node=arrivals[members[0]]["nproc_per_node"])
    model = sized_model(cfg)
    result = measurement.result()
    if "error" not in result:
        return {"members": members, "result": result, "traffic": step_traffic(cfg, arrivals, members, result, model)}
    errors = {}
    deadline = time.monotonic() + 3  # the other nodes' own errors, which name their side
    while time.monotonic() < deadline and len(errors) < len(members) - 1:
        errors = {str(i): store.take(f"bandwidth/error/{i}", 1)["error"] for i in members
                  if i != index and store.has(f"bandwidth/error/{i}")}
        time.sleep(0.1)
    errors[str(index)] = result["error"]
    return {"members": members, "result": result, "errors": errors}


def sized_model(cfg):
    """traffic.ModelFacts of the config's model, or the reason it cannot be sized."""
    from meshtune.doctor.traffic import model_facts

    try:
        return model_facts(cfg)
    except Exception as exc:  # noqa: BLE001 - a missing or odd model is the model row's; here only no estimate
        return f"cannot size the model: {exc}"


def step_traffic(cfg, arrivals: dict, members: list[int], result: dict, model) -> dict:
    """The verdict on the measured link for this config (traffic.py)."""
    from meshtune.doctor.traffic import verdict

    if isinstance(model, str):
        return {"error": model}
    memories = [m for i in members for m in arrivals[i]["accelerators"].get("memory", [])]
    gpu_bytes = min(memories) if memories else None
    if gpu_bytes and cfg.gpu_memory_limit:
        gpu_bytes = min(gpu_bytes, cfg.gpu_memory_limit * 2**30)
    return verdict(cfg, len(members), arrivals[members[0]]["nproc_per_node"], result["backend"] == "nccl", gpu_bytes,
                   result["all_reduce"][-1]["busbw"], result.get("peak_flops"), model)


def finish(store: DoctorStore, verdict: dict, nodes: int) -> tuple[int, dict]:
    """Post the verdict, let the others read it, then mark the store closing: they start torchrun only after."""
    store.put("verdict", verdict)
    deadline = time.monotonic() + READ_WAIT_S
    while store.store.add("read", 0) < nodes - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    store.store.set("closing", "")
    deadline = time.monotonic() + READ_WAIT_S
    while store.store.add("left", 0) < store.store.add("read", 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    return verdict["code"], verdict.get("report") or {k: verdict[k] for k in ("skipped", "message") if k in verdict}


def join(cfg, settings: LaunchSettings, store: DoctorStore, timeout_s: float, bandwidth: bool, out) -> tuple[int, dict]:
    """A node other than 0: post its facts, answer node 0's clock check, measure if asked, print its rows."""
    token = store.store.get("token").decode()
    facts = this_node(cfg, settings, token, bandwidth)
    index = store.post(facts)
    deadline = time.monotonic() + NODE0_FACTS_WAIT_S
    while not store.has(f"clock/ping/{index}") and not store.has("bandwidth/plan") and time.monotonic() < deadline:
        time.sleep(0.01)
    if store.has(f"clock/ping/{index}"):
        store.store.set(f"clock/pong/{index}", repr(time.time()))
    plan = store.take("bandwidth/plan", timeout_s + 30)
    if index in plan["members"]:
        result = Measurement(settings.master_addr, settings.master_port, plan["prefix"],
                             plan["members"].index(index), len(plan["members"]), plan["backend"]).result()
        if "error" in result:
            store.put(f"bandwidth/error/{index}", result)
    return follow(store, settings, index, out)


def follow(store: DoctorStore, settings: LaunchSettings, index: int, out) -> tuple[int, dict]:
    """Wait for node 0's verdict, print the rows that concern this node, and wait for node 0 to close its store."""
    verdict = store.take("verdict", DEADLINE_S + 60)
    store.store.add("read", 1)
    try:  # node 0 closes its store once every node has left it: only then may torchrun's take the port
        store.store.set_timeout(timedelta(seconds=READ_WAIT_S + 5))
        store.store.get("closing")
        store.store.add("left", 1)
    except Exception:  # noqa: BLE001 - node 0 has gone already
        pass
    if "skipped" in verdict:
        return verdict["code"], {"skipped": verdict["skipped"]}
    if "message" in verdict:  # node 0 failed to finish: this node's report is that message
        out(f"meshtune doctor, node {settings.node_rank}: {verdict['message']}")
        return verdict["code"], {"message": verdict["message"]}
    report = verdict["report"]
    column = next((c for c in report["columns"] if c["index"] == index), None)
    if column is None:  # node 0 had stopped waiting (an elastic job above its minimum, or past the timeout)
        out(f"meshtune doctor, node {settings.node_rank}: joined after node 0 closed its checks; not in its table")
        return verdict["code"], {**report, "late": True}
    mine = [row for row in report["rows"] if str(column["position"]) in row["cells"]
            and row["cells"][str(column["position"])][0] != OK]
    out(f"meshtune doctor, node {settings.node_rank}: node 0 printed the table; "
        + ("every check passed here" if not mine else f"{len(mine)} check(s) need attention here:"))
    for row in mine:
        mark, text = row["cells"][str(column["position"])]
        out(f"  {mark} {row['check']}: {text}")
        for fix in row["fixes"]:
            out(f"      fix: {fix}")
    return verdict["code"], {**report, "mine": mine}


def run_alone(cfg, settings: LaunchSettings, out, bandwidth: bool = False) -> tuple[int, dict]:
    facts = collect_facts(cfg, settings)
    facts["output_dir"]["sees node 0's file"] = True
    report = evaluate(cfg, settings, {0: facts}, {0: 0.0}, 0)
    out(render(report))
    if bandwidth:
        out("bandwidth: one node, nothing to measure between nodes")
    return (1 if report["failed"] else 0), report


def unreachable(settings: LaunchSettings, timeout_s: float, exc: Exception, out) -> tuple[int, dict]:
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
