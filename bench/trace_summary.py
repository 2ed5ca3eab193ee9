"""Where a profiled window's GPU time went, rank by rank, from the Chrome traces `profile_steps` writes
(output_dir/profile/rank{R}.json).

For each trace: the window (first to last GPU event), the time the GPU computed (kernels and copies other than NCCL,
their union across streams), the time NCCL kernels ran, the NCCL time not hidden behind compute, the time nothing
ran at all, and the longest idle gaps with what the host was doing when each began (the innermost host operator
running then). A rank whose NCCL kernels run much longer than another's waits in them for the slower rank; a GPU
idle while its host is in Python is host-bound.

  python3 bench/trace_summary.py out/profile/rank0.json out/profile/rank1.json [--gaps 12] [--min-gap-ms 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_right
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "python_function", "user_annotation"}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping [start, end) intervals merged, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the merged intervals `a` outside the merged intervals `b`."""
    out, j = [], 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def host_op_at(ops: list[dict], starts: list[float], time: float) -> str:
    """The innermost (shortest) host operator running at `time`, or '-'."""
    best = None
    for op in ops[max(0, bisect_right(starts, time) - 2000):bisect_right(starts, time)]:
        if op["ts"] <= time < op["ts"] + op["dur"] and (best is None or op["dur"] < best["dur"]):
            best = op
    return best["name"] if best else "-"


def summarize(trace: dict, gaps: int, min_gap_ms: float) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise ValueError("no GPU events (a CPU run, or a trace without ProfilerActivity.CUDA)")
    nccl = union([(e["ts"], e["ts"] + e["dur"]) for e in device if "nccl" in e["name"].lower()])
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in device if "nccl" not in e["name"].lower()])
    busy = union(nccl + compute)
    window = (busy[0][0], busy[-1][1])
    idle = subtract([window], busy)
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    longest = sorted((g for g in idle if g[1] - g[0] >= min_gap_ms * 1000), key=lambda g: g[0] - g[1])
    return dict(window_ms=(window[1] - window[0]) / 1000, compute_ms=total(compute) / 1000,
                nccl_ms=total(nccl) / 1000, nccl_exposed_ms=total(subtract(nccl, compute)) / 1000,
                idle_ms=total(idle) / 1000,
                gaps_over_min=len(longest), gaps_over_min_ms=total(longest) / 1000,
                gaps=[dict(at_ms=(s - window[0]) / 1000, ms=(e - s) / 1000, host=host_op_at(host, starts, s))
                      for s, e in longest[:gaps]])


def render(names: list[str], summaries: list[dict], min_gap_ms: float) -> str:
    rows = [("window (first to last GPU event)", "window_ms"),
            ("GPU computing (non-NCCL kernels, union)", "compute_ms"),
            ("NCCL kernels running", "nccl_ms"), ("NCCL not hidden behind compute", "nccl_exposed_ms"),
            ("GPU idle (nothing running)", "idle_ms"), (f"idle gaps of {min_gap_ms:g} ms or more", "gaps_over_min_ms")]
    lines = ["| ms | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(f"{s[key]:.1f}" for s in summaries) + " |")
    lines.append("| number of those gaps | " + " | ".join(str(s["gaps_over_min"]) for s in summaries) + " |")
    for name, s in zip(names, summaries):
        lines.append(f"\n{name}: longest idle gaps (ms into the window, length, host operator when it began)")
        lines += [f"  {g['at_ms']:9.1f}  {g['ms']:7.2f} ms  {g['host']}" for g in s["gaps"]]
    return "\n".join(lines) + "\n"


def summarize_files(paths: list[Path], gaps: int = 12, min_gap_ms: float = 1.0) -> str:
    """The table of `render` for trace files, each named by its stem (rank0, rank1, ...). ValueError names the file
    whose trace has no GPU events."""
    summaries = []
    for path in paths:
        try:
            summaries.append(summarize(json.loads(Path(path).read_text()), gaps, min_gap_ms))
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
    return render([Path(path).stem for path in paths], summaries, min_gap_ms)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="Chrome trace files (output_dir/profile/rank{R}.json)")
    p.add_argument("--gaps", type=int, default=12, help="longest idle gaps listed per trace")
    p.add_argument("--min-gap-ms", type=float, default=1.0, help="idle gaps counted from this length")
    args = p.parse_args(argv)
    try:
        sys.stdout.write(summarize_files(args.traces, args.gaps, args.min_gap_ms))
    except (OSError, ValueError) as error:
        print(f"trace_summary: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
