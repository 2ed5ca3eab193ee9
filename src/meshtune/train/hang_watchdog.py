"""A hung collective, caught long before `ddp_timeout`, with word of which rank is stuck and where.

A thread in every rank watches the optimizer steps. When none completes within the hang timeout (evaluations,
checkpoint writes and torch.compile at work pause the clock), each rank that can still run Python writes
`output_dir/hang-<time>/rank<R>.txt`: where the loop was, the stacks of all its threads (faulthandler) and torch's
flight recorder (its last collectives and their states: NCCL, and gloo where this torch records it). The ranks agree
on the folder through the job's store. The lowest rank that reported writes `summary.txt`: the ranks that never
reported (stopped, dead, or stuck outside Python holding the interpreter) and those not at the same place as the
others. On each node its lowest reporting rank says in one line what the node lost (the other node and the step,
when none of that node's ranks reported: a network partition, or a dead node) and leaves it in its launcher's mailbox.
Then the reporting ranks exit with `HANG_EXIT`, so torchrun stops the rest and starts all workers again, from the
newest checkpoint.

Nothing in the report waits on the network without a bound: across a partition a store client's read never returns
(the TCP connection neither answers nor fails for many minutes), so the store is asked from a thread of its own.

While no hang timeout applies yet (the first steps, which compile and warm up), rank 0 says every minute that a step
is still running, where, whether torch.compile is at work, and, on GPUs, what the allocator holds and how often it
has retried: a run stuck in its first step is then never silent, and an allocator at the card's limit (retries
climbing) is told apart from a stuck collective (nothing moves).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import pickle
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from meshtune.distributed import DistEnv
from meshtune.mailbox import Mailbox
from meshtune.train.stragglers import Place

HANG_EXIT = 75  # non-zero, so torchrun restarts the workers; distinct, so a log shows why
AUTO_FLOOR_S = 60  # the automatic timeout never goes below this: a slow step is not a hang
AUTO_STEPS = 5  # step times seen before the automatic timeout is set (the first steps compile and warm up)
AUTO_FACTOR = 5  # the automatic timeout: this many times the median step
RECENT_STEPS = 200  # the median is of the last this many steps
FLIGHT_RECORDER_ENTRIES = 2000  # collectives torch's flight recorder keeps for the dump (TORCH_FR_BUFFER_SIZE)
SLOW_STEP_NOTICE_S = 60  # while no hang timeout applies: rank 0's word on a step still running, this often
CHECK_EVERY_S = 1.0  # how often the watch looks at the clock
STORE_ANSWER_S = 5  # the most the report waits for the job's store to name its folder (none answers across a partition)
REPORT_WAIT_MAX_S = 30  # the most a reporting rank waits for the others' reports (hang timeout / 2, at least 5 s)

reporting = threading.Event()  # this rank's watchdog is writing its report and will end the process

logger = logging.getLogger(__name__)


def enable_flight_recorder() -> None:
    """Before the NCCL process group exists: keep its recent collectives for a hang report (the user's value wins)."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch 2.9's name, and the one before
    if not set(names) & set(os.environ):
        os.environ[names[0] if torch_version() >= (2, 9) else names[1]] = str(FLIGHT_RECORDER_ENTRIES)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


class HangWatchdog:
    """`with HangWatchdog(...) as watch:` around the step loop; the loop calls `at` as it moves, `step_done` after
    each step, and pauses the clock with `paused` around evaluations and saves.

    `timeout` None: 5 x the median step of the steps so far once 5 are done, at least 60 s, at most 80% of
    `ddp_timeout` (beyond it the collective fails first); 0: off, notices included. The clock starts when the first
    step is done; before a timeout applies, rank 0 logs a notice every SLOW_STEP_NOTICE_S that a step is running.
    """

    def __init__(self, timeout: int | None, ddp_timeout: int, output_dir: Path, env: DistEnv, places: list[Place],
                 start_step: int = 0):
        self.explicit, self.ddp_timeout = timeout, ddp_timeout
        self.output_dir, self.env, self.places = output_dir, env, places
        self.enabled = timeout != 0 and env.world_size > 1
        self.notices = timeout != 0 and env.is_main
        self._next_notice = SLOW_STEP_NOTICE_S
        self.step, self.where, self.start_step = 0, "starting the loop", start_step
        self._last = time.monotonic()
        self._steps_done = 0
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)  # after the first: the median is read every second
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HangWatchdog:
        if self.enabled or self.notices:
            self._thread = threading.Thread(target=self._watch, name="meshtune-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def at(self, step: int, where: str) -> None:
        """The loop is now at `where` of optimizer step `step` (two attribute writes: free per step)."""
        self.step, self.where = step, where

    def step_done(self) -> None:
        now = time.monotonic()
        if self._steps_done:  # the first step compiles and warms up
            self._recent.append(now - self._last)
        self._steps_done += 1
        self._last = now
        self._next_notice = SLOW_STEP_NOTICE_S

    @contextmanager
    def paused(self, where: str):
        """Work that may rightly take longer than a step (evaluation, a checkpoint write)."""
        self.where = where
        self._paused += 1
        started = time.monotonic()
        try:
            yield
        finally:
            self._last += time.monotonic() - started  # the pause is not step time
            self._paused -= 1

    def timeout(self) -> float | None:
        """Seconds without a completed step that count as a hang; None while not yet known."""
        if not self._steps_done:  # the first step compiles and warms up: only ddp_timeout bounds it
            return None
        if self.explicit:
            return float(self.explicit)
        if len(self._recent) < AUTO_STEPS:
            return None
        return min(max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(self._recent)), 0.8 * self.ddp_timeout)

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            if self._check():
                return

    def _check(self) -> bool:
        """One look at the clock: a notice while no timeout applies; past the timeout, the report (True)."""
        if self._paused:
            return False
        idle = time.monotonic() - self._last
        limit = self.timeout()
        if limit is None:
            if self.notices and idle >= self._next_notice:
                logger.info(self.slow_step_notice(idle))
                self._next_notice += SLOW_STEP_NOTICE_S
            return False
        if self.enabled and idle > limit and not main_thread_compiling():
            self._report_and_exit(idle, limit)
            return True
        return False

    def slow_step_notice(self, idle: float) -> str:
        compiling = " (torch.compile at work)" if main_thread_compiling() else ""
        text = f"meshtune: step {self.step} still running after {idle:.0f} s, at: {self.where}{compiling}"
        device = self.env.device
        if device.type == "cuda":  # host-side counters: no sync with the step in flight
            gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
            total = torch.cuda.get_device_properties(device).total_memory
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            text += (f"; GPU {device.index}: {gib(torch.cuda.memory_allocated(device))} GiB allocated, "
                     f"{gib(torch.cuda.memory_reserved(device))} held by the allocator of {gib(total)}, {retries} "
                     f"allocator retries (retries that climb between notices: the step is at the card's limit; "
                     f"lower memory_budget)")
        return text

    def _report_and_exit(self, idle: float, limit: float) -> None:
        reporting.set()
        folder = self._agree_on_folder()
        folder.mkdir(parents=True, exist_ok=True)
        rank = self.env.rank
        here = {"rank": rank, "step": self.step, "where": self.where, "idle_s": round(idle, 1),
                "node": self.places[rank].node, "host": self.places[rank].host, "pid": os.getpid()}
        try:
            entries = flight_record_entries()
        except Exception:  # noqa: BLE001 - a report without it is still worth writing
            entries = None
        if entries:
            here["last_collective"] = [entries[-1].get("collective_seq_id"), entries[-1].get("profiling_name")]
        with (folder / f"rank{rank}.txt").open("w") as out:
            out.write(f"meshtune hang report: rank {rank} of {self.env.world_size} (node {here['node']}, host "
                      f"{here['host']}, pid {here['pid']}), "
                      f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n"
                      f"step {self.step}, at: {self.where}; no optimizer step completed for {idle:.0f} s "
                      f"(hang timeout {limit:.0f} s)\n\nPython stacks of every thread:\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.write("\n" + flight_record(entries))
        (folder / f"rank{rank}.json").write_text(json.dumps(here))
        time.sleep(report_wait(limit))  # time for the other ranks to report
        reported = sorted(int(p.stem[4:]) for p in folder.glob("rank*.json"))
        if reported and reported[0] == rank:
            (folder / "summary.txt").write_text(self.summary(folder, reported, limit))
            print((folder / "summary.txt").read_text(), file=sys.stderr, flush=True)
        for silent, pid in kill_silent_local_workers(set(range(self.env.world_size)) - set(reported)):
            print(f"meshtune: rank {rank}: killing rank {silent} (pid {pid}, same node), which did not report",
                  file=sys.stderr, flush=True)
        node = self.places[rank].node
        if rank == min(r for r in reported + [rank] if self.places[r].node == node):  # one line a node
            lost = self.lost_nodes(reported)
            line = self.node_line(idle, limit, folder, reported, lost)
            print(line, file=sys.stderr, flush=True)  # before the mark: the launcher may end torchrun on reading it
            if lost and (mailbox := Mailbox.of_launcher()) is not None:
                mailbox.mark_peers_lost(line, lost, self.step)
        os._exit(HANG_EXIT)

    def lost_nodes(self, reported: list[int]) -> list[int]:
        """The other nodes none of whose ranks reported: cut off by the network, or stopped or dead as a whole."""
        nodes = {place.node for place in self.places}
        heard = {self.places[r].node for r in reported} | {self.places[self.env.rank].node}
        return sorted(nodes - heard)

    def node_line(self, idle: float, limit: float, folder: Path, reported: list[int], lost: list[int]) -> str:
        """This node's one line on the console: what it lost, at which step, and what happens next."""
        node = self.places[self.env.rank].node
        head = (f"meshtune: node {node}: no optimizer step completed for {idle:.0f} s at step {self.step} (hang "
                f"timeout {limit:.0f} s)")
        then = (f"stacks in {folder}; its workers exit so torchrun restarts them from the newest checkpoint once the "
                f"nodes meet again (up to rdzv_timeout)")
        if lost:
            names = ", ".join(f"node {n} ({self.host_of(n)})" for n in lost)
            return (f"{head}: lost {names}, none of whose ranks answered: a network partition, or that node stopped "
                    f"or died; {then}")
        silent = [r for r in range(self.env.world_size) if r not in reported]
        if silent:
            return (f"{head}: rank(s) {', '.join(map(str, silent))} did not report (see summary.txt); {then}")
        return f"{head}: every rank is stuck at the same place (see summary.txt); {then}"

    def host_of(self, node: int) -> str:
        return next(place.host for place in self.places if place.node == node)

    def _agree_on_folder(self) -> Path:
        """One folder for every rank of this hang: the first to ask names it by its clock, in the job's store;
        when the store cannot answer (the rank hosting it is the one stuck), by the step this attempt started from,
        which every rank knows alike (not the step it is at: a rank elsewhere may be at another)."""
        answer: list[str] = []

        def ask() -> None:
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set_timeout(timedelta(seconds=STORE_ANSWER_S))
                proposed = "hang-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
                key = f"meshtune/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                answer.append(store.compare_set(key, "", proposed).decode())
            except Exception:  # noqa: BLE001 - any store failure: the fallback name every rank derives alike
                pass

        asking = threading.Thread(target=ask, name="meshtune-hang-folder", daemon=True)
        asking.start()
        asking.join(STORE_ANSWER_S)  # a read across a partition never returns: the thread is left to the exit
        return self.output_dir / (answer[0] if answer else f"hang-since-step{self.start_step}")

    def summary(self, folder: Path, reported: list[int], limit: float) -> str:
        """Who reported, who did not, and who is somewhere else than the rest."""
        reports = [json.loads((folder / f"rank{r}.json").read_text()) for r in reported]
        silent = [r for r in range(self.env.world_size) if r not in reported]
        places = [(report["step"], report["where"]) for report in reports]
        common = max(set(places), key=places.count)
        elsewhere = [report for report, place in zip(reports, places) if place != common]
        lines = [f"meshtune hang summary: no optimizer step completed for {limit:.0f} s (hang timeout) in a job of "
                 f"{self.env.world_size} ranks",
                 f"{len(reported)} rank(s) reported; most are at step {common[0]}, {common[1]}"]
        for r in silent:
            place = self.places[r]
            lines.append(f"  rank {r} (node {place.node}, host {place.host}) did not report: its process is "
                         f"stopped, dead, or stuck outside Python; the others wait for it")
        for report in elsewhere:
            lines.append(f"  rank {report['rank']} (node {report['node']}, host {report['host']}) is elsewhere: "
                         f"step {report['step']}, {report['where']}")
        collectives = [tuple(report["last_collective"]) for report in reports if "last_collective" in report]
        if collectives:
            usual = max(set(collectives), key=collectives.count)
            for report in reports:
                if "last_collective" in report and tuple(report["last_collective"]) != usual:
                    seq, name = report["last_collective"]
                    lines.append(f"  rank {report['rank']} is in another collective than the others: #{seq} {name}, "
                                 f"the others #{usual[0]} {usual[1]}")
        if not silent and not elsewhere:
            lines.append("  every rank reported at the same place: the collective itself is stuck (network, NCCL); "
                         "see the flight recorder in the rank files")
        lines.append(f"stacks of each reporting rank: {folder}/rank<R>.txt")
        return "\n".join(lines) + "\n"


def report_wait(limit: float) -> float:
    """How long a reporting rank waits for the others' reports before the summary."""
    return min(float(REPORT_WAIT_MAX_S), max(5.0, limit / 2))


def await_report(timeout_s: float = STORE_ANSWER_S + REPORT_WAIT_MAX_S + 10) -> None:
    """In a rank whose step failed (a collective broke as a peer went away): while this rank's watchdog writes its
    report, wait for it to end the process, so that the report and the node's line are not cut short."""
    if reporting.is_set():
        time.sleep(timeout_s)


def kill_silent_local_workers(silent: set[int]) -> list[tuple[int, int]]:
    """SIGKILL the ranks in `silent` that are workers of this node's torchrun agent (its other children of the same
    run id and attempt); returns (rank, pid) of each. A rank that did not report is stopped or stuck outside Python:
    torchrun's SIGTERM cannot end it (a stopped process keeps it pending; a stuck one never runs meshtune's SIGTERM
    handler), and torchrun waits a fixed 30 s before its SIGKILL when it restarts the workers, 30 s added to every
    recovery. Other nodes' silent ranks are left to their own agents."""
    attempt = torchrun_attempt(os.environ)
    if not silent or attempt[0] is None:
        return []
    try:
        siblings = [process for process in psutil.Process().parent().children() if process.pid != os.getpid()]
    except (psutil.Error, AttributeError):  # the agent is gone (no parent)
        return []
    killed = []
    for sibling in siblings:
        try:
            environ = sibling.environ()
            if torchrun_attempt(environ) != attempt:
                continue  # not a worker of this attempt
            rank = environ.get("RANK", "")
            if not rank.isdigit() or int(rank) not in silent:
                continue
            sibling.kill()
            killed.append((int(rank), sibling.pid))
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return sorted(killed)


def torchrun_attempt(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The run id and restart count torchrun gave a worker."""
    return environ.get("TORCHELASTIC_RUN_ID"), environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def main_thread_compiling() -> bool:
    """torch.compile at work (a new sample length or code path can take a minute): slow, not hung."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_filename.endswith(("_dynamo/convert_frame.py", "_inductor/compile_fx.py")):
            return True
        frame = frame.f_back
    return False


def flight_record_entries() -> list[dict]:
    """torch's flight recorder: this rank's recent collectives (NCCL; gloo too where torch records it)."""
    c10d = torch._C._distributed_c10d
    # older torch keeps NCCL's collectives in a recorder of their own; newer torch has one for every backend
    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    entries = pickle.loads(dump(True, False, False)).get("entries", [])
    return sorted(entries, key=lambda entry: entry.get("record_id", 0))  # a ring buffer: oldest first


def flight_record(entries: list[dict] | None, last: int = 30) -> str:
    """The last collectives as text: sequence number, process group, operation, state, sizes."""
    if entries is None:
        return "flight recorder: unavailable in this torch build\n"
    entries = entries[-last:]
    lines = [f"flight recorder: the last {len(entries)} collectives (seq, process group, operation, state, sizes)"]
    for entry in entries:
        lines.append(f"  {entry.get('collective_seq_id')}  pg {entry.get('process_group')}  "
                     f"{entry.get('profiling_name')}  {entry.get('state')}  in {entry.get('input_sizes')}")
    return "\n".join(lines) + "\n"
