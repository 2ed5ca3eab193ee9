"""`meshtune doctor --bandwidth`: how fast the link between the nodes carries the collectives training runs.

One process a node (node 0 first) forms a torch.distributed process group in the doctor's own store (a
PrefixStore of it): gloo on CPU, NCCL on the node's first visible GPU when every node has GPUs. It times
all-reduce over all of them from 1 KiB (the latency) up to 16 MiB (CPU) or 256 MiB (GPU), and reports what
nccl-tests reports: algbw = bytes / time and busbw = algbw x 2(n-1)/n, the rate each node's link carries whatever
the number of nodes. Then pairs of nodes exchange data both ways at once, a round of disjoint pairs at a time, so a
slow link or network card is named.

It runs in a child process with a deadline: a hung collective cannot hold the doctor, and no CUDA context stays in
the launcher that starts training next. With one process a node it measures one GPU's path between the nodes; a
node with a network card per GPU moves more at once when all its GPUs train.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta

SIZES = {"cpu": [2**10, 2**20, 16 * 2**20], "cuda": [2**10, 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]}
PAIR_BYTES = {"cpu": (2**20, 4 * 2**20), "cuda": (2**20, 64 * 2**20)}  # smallest, largest exchange
SIZE_BUDGET_S = 2.0        # the repeats of one size; a larger size is measured only when its repeats fit
PAIR_EXCHANGE_S = 0.1      # a pair's exchange is sized to take about this long at the measured bandwidth
PAIR_REPEATS = 3
PAIR_ROUNDS = 15           # every pair up to 16 nodes; beyond, each node meets 15 others
PROCESS_GROUP_TIMEOUT_S = 20
DEADLINE_S = 60            # the child's whole life: start, process group, measurements


def duration_text(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def repeats(size: int) -> int:
    return 20 if size <= 64 * 2**10 else 10 if size <= 4 * 2**20 else 5


def bus_bandwidth(size: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) of an all-reduce of `size` bytes over `ranks` in `seconds`, in bytes/s, as nccl-tests: a ring
    all-reduce sends 2(n-1)/n of the buffer over each link."""
    algbw = size / seconds
    return algbw, algbw * 2 * (ranks - 1) / ranks


def pair_rounds(n: int, limit: int = PAIR_ROUNDS) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs of ranks (the circle method): n-1 rounds (n for an odd n) meet every pair once;
    the first `limit` of them are kept."""
    players: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(min(len(players) - 1, limit)):
        half = len(players) // 2
        pairs = [(players[i], players[-1 - i]) for i in range(half)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


class Measurement:
    """This node's part of the measurement, running in a child process from construction: `result()` waits for
    it (the same on every rank), or says why there is none (the process group did not form, the deadline
    passed). The caller is free meanwhile."""

    def __init__(self, master_addr: str, master_port: int, prefix: str, rank: int, ranks: int, backend: str,
                 peak: bool = False, deadline_s: float = DEADLINE_S, processes_a_node: int = 1):
        context = multiprocessing.get_context("spawn")
        self._receive, send = context.Pipe(duplex=False)
        self._child = context.Process(target=_child, daemon=True, args=(send, dict(
            master_addr=master_addr, master_port=master_port, prefix=prefix, rank=rank, ranks=ranks,
            backend=backend, peak=peak, processes_a_node=processes_a_node)))
        self._deadline = time.monotonic() + deadline_s
        self._deadline_s = deadline_s
        self._child.start()
        send.close()

    def result(self) -> dict:
        try:
            if self._receive.poll(max(0.0, self._deadline - time.monotonic())):
                return self._receive.recv()
            return {"error": f"no result within {self._deadline_s:g} s (a collective hung: a node's network, or a "
                             f"firewall between the nodes)"}
        except EOFError:
            self._child.join(5)
            return {"error": f"the measuring process ended without a result (exit code {self._child.exitcode})"}
        finally:
            if self._child.is_alive():
                self._child.kill()
            self._child.join(5)


def _child(send, spec: dict) -> None:
    try:
        send.send(benchmark(**spec))
    except Exception as exc:  # noqa: BLE001 - reported in the doctor's table, with the node
        send.send({"error": f"{type(exc).__name__}: {exc}"})
    send.close()
    os._exit(0)  # gloo's and NCCL's threads may still hold tensors: no interpreter finalisation


def benchmark(master_addr: str, master_port: int, prefix: str, rank: int, ranks: int, backend: str,
              peak: bool, processes_a_node: int = 1) -> dict:
    """The sweeps on this node's rank; with `peak`, rank 0 also measures a training process's matmul rate: a GPU's
    bf16, or on CPU the fp32 rate of one of `processes_a_node` processes sharing the node's cores."""
    import torch
    import torch.distributed as dist

    from meshtune.hardware import cpu_flops_a_process, measure_peak_flops

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    store = dist.PrefixStore(prefix, dist.TCPStore(master_addr, master_port, None, False, timeout=timeout,
                                                   wait_for_workers=False))
    started = time.monotonic()
    dist.init_process_group(backend, store=store, rank=rank, world_size=ranks, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    formed_s = time.monotonic() - started
    try:
        sweep = all_reduce_sweep(device, ranks)
        pairs = pair_sweep(device, ranks, sweep[-1]["busbw"])
        flops = None
        if peak and rank == 0:
            flops = measure_peak_flops(device) if device.type == "cuda" else cpu_flops_a_process(processes_a_node)
    finally:
        dist.destroy_process_group()
    return {"backend": backend, "device": device.type, "ranks": ranks, "process_group_s": formed_s,
            "all_reduce": sweep, "pairs": pairs, "rounds": len(pair_rounds(ranks)),
            "every_pair": len(pair_rounds(ranks)) == len(pair_rounds(ranks, limit=ranks)), "peak_flops": flops}


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, device) -> float:
    """The slowest rank's time: every rank then decides alike (sizes to try, exchange size)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def all_reduce_sweep(device, ranks: int) -> list[dict]:
    """Each size's repeats within SIZE_BUDGET_S; a size whose one all-reduce would take longer, predicted from the
    last two sizes (latency + bytes / bandwidth), is not tried."""
    import torch
    import torch.distributed as dist

    results: list[dict] = []
    for size in SIZES[device.type]:
        if len(results) >= 2:
            (small, t_small), (large, t_large) = [(r["bytes"], r["seconds"]) for r in results[-2:]]
            predicted = t_large + (size - large) * max(t_large - t_small, 0.0) / (large - small)
            if predicted > SIZE_BUDGET_S:
                break
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)  # zeros: sums never overflow
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer)  # the first one of a size also sets up its buffers
        synchronize(device)
        first = slowest(time.perf_counter() - start, device)
        count = max(1, min(repeats(size), int(SIZE_BUDGET_S / max(first, 1e-6))))
        start = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(buffer)
        synchronize(device)
        seconds = slowest((time.perf_counter() - start) / count, device)
        algbw, busbw = bus_bandwidth(size, seconds, ranks)
        results.append({"bytes": size, "seconds": seconds, "algbw": algbw, "busbw": busbw, "repeats": count})
    return results


def pair_sweep(device, ranks: int, busbw: float) -> list[dict]:
    """Each pair of a round sends and receives `size` bytes at once (batch_isend_irecv: NCCL needs both posted
    together); a pair's time is its slower side's."""
    import torch
    import torch.distributed as dist

    smallest, largest = PAIR_BYTES[device.type]
    size = int(min(largest, max(smallest, busbw * PAIR_EXCHANGE_S))) // 4 * 4
    outgoing = torch.zeros(size // 4, dtype=torch.float32, device=device)
    incoming = torch.empty_like(outgoing)
    me = dist.get_rank()
    seconds = torch.zeros(ranks, ranks, dtype=torch.float64, device=device)

    def exchange(partner: int) -> None:
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, partner),
                                               dist.P2POp(dist.irecv, incoming, partner)]):
            request.wait()

    for pairs in pair_rounds(ranks):
        partner = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if partner is None:
            continue
        exchange(partner)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(PAIR_REPEATS):
            exchange(partner)
        synchronize(device)
        seconds[me, partner] = (time.perf_counter() - start) / PAIR_REPEATS
    dist.all_reduce(seconds)  # each rank filled its own row
    table = seconds.cpu()
    return [{"a": a, "b": b, "bytes": size, "seconds": t, "bandwidth": size / t}
            for pairs in pair_rounds(ranks) for a, b in pairs
            if (t := max(table[a, b].item(), table[b, a].item())) > 0]
