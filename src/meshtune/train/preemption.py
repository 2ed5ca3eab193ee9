"""Stopping on SIGTERM, what SLURM, Kubernetes and most schedulers send before they preempt or cancel a job.

The signal only raises a flag: in each worker when the scheduler signals every process (SLURM), or in the
meshtune launcher alone (Kubernetes signals the container's first process), which then leaves a stop file for its
workers instead of passing the signal to torchrun. Ranks agree on the flag in the all-reduce every step already
does (step_counts) and read the agreed value at the next step's start (a step late, so a GPU never waits for
it): every rank finishes the step in progress and the next, and all stop before the same step, even on nodes
that were never signalled. The job then writes a checkpoint if `stop_grace_period` leaves room for one (judged from the
last save's duration), and the process exits with 128 + the signal number: the code TorchElastic gives a
signalled job and Kubernetes' ExitCode restart policy retries. Relaunched, the run resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from meshtune.mailbox import Mailbox


class StopRequest:
    """Installed for the run (`with StopRequest(mailbox) as stop:`); the previous SIGTERM handler is restored after."""

    def __init__(self, mailbox: Mailbox | None = None):
        self.signum: int | None = None
        self.received_at: float | None = None
        self._previous = None
        self._mailbox = mailbox  # where a signalled launcher leaves its stop request
        self._tallied: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._host: torch.Tensor | None = None  # pinned: the agreed vote's copy, made without a wait

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, _frame) -> None:
        # a repeat (the scheduler signals every process, torchrun forwards it again) changes nothing
        if self.received_at is None:
            self.signum, self.received_at = signum, time.monotonic()

    @property
    def vote(self) -> float:
        """This rank's contribution to the step's all-reduce (summed): 1 once signalled, else 0."""
        if self.signum is None and self._mailbox is not None and (signum := self._mailbox.stop_requested()):
            self.signum, self.received_at = signum, time.monotonic()
        return float(self.signum is not None)

    def tally(self, votes: torch.Tensor) -> None:
        """Keep this step's all-reduced votes for `due` at the next step's start; on a GPU the copy to the host is
        queued behind the all-reduce, so neither waits for the step's compute."""
        if votes.device.type != "cuda":
            self._tallied = votes, None
            return
        if self._host is None:
            self._host = torch.zeros((), dtype=votes.dtype, pin_memory=True)
        self._host.copy_(votes, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._tallied = self._host, event

    def due(self) -> int:
        """At a step's start: the signal that stops the run if any rank voted in the previous step, else 0.
        Every rank reads the same all-reduced sum at the same step, so all stop together."""
        if self._tallied is None:
            return 0
        votes, event = self._tallied
        self._tallied = None
        if event is not None:
            event.synchronize()
        if not votes.item():
            return 0
        if self.signum is None:  # another rank was signalled: this one stops with it
            self.signum, self.received_at = signal.SIGTERM, time.monotonic()
        return self.signum

    def save_fits(self, grace_s: float, expected_save_s: float | None, device: torch.device) -> tuple[bool, str]:
        """Whether a checkpoint can be written before the grace period ends, decided alike on every rank: the
        longest wait since a rank was signalled plus the last save's duration (the longest rank's) must fit."""
        waited = time.monotonic() - (self.received_at or time.monotonic())
        numbers = torch.tensor([waited, expected_save_s or 0.0], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
        waited, expected = numbers.tolist()
        if grace_s <= 0:
            return False, "stop_grace_period is 0"
        left = grace_s - waited
        if expected_save_s is not None and expected * 1.2 > left:
            return False, (f"the last save took {expected:.0f} s and {left:.0f} s of stop_grace_period={grace_s} s "
                           f"are left")
        return True, f"{left:.0f} s of stop_grace_period={grace_s} s left"


def exit_code(signum: int) -> int:
    """128 + the signal number: what a shell, TorchElastic and Kubernetes read as 'ended by that signal'."""
    return 128 + signum

