"""The hang watchdog's timeout rules and the straggler warning's streaks, without a job (the two-node job that
stops a rank and slows another is in test_faults.py), and which local processes it kills for a silent rank."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from meshtune.distributed import DistEnv
from meshtune.train.hang_watchdog import HangWatchdog
from meshtune.train.stragglers import Place, StepTimes
from processes import alive, kill_tree

ENV = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=2, device=torch.device("cpu"))
PLACES = [Place(0, "a"), Place(0, "a"), Place(1, "b"), Place(1, "b")]


def watchdog(timeout, ddp_timeout=600, durations=()):
    watch = HangWatchdog(timeout, ddp_timeout, output_dir=None, env=ENV, places=PLACES)
    for seconds in durations:  # steps done, the first of them the warm-up
        watch._last = time.monotonic() - seconds
        watch.step_done()
    return watch


def test_the_hang_folder_is_named_without_the_store_when_it_does_not_answer(monkeypatch, tmp_path):
    """Across a partition a store client's read neither answers nor fails (the TCP connection hangs for minutes):
    the report names its folder without it within the bound, by the step the workers started from."""
    import threading

    import torch.distributed as dist

    from meshtune.train import hang_watchdog

    class HungStore:  # a store on the other side of a partition
        def set_timeout(self, timeout):
            pass

        def compare_set(self, *args):
            threading.Event().wait()

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: HungStore())
    monkeypatch.setattr(hang_watchdog, "STORE_ANSWER_S", 0.5)
    watch = HangWatchdog(10, 600, output_dir=tmp_path, env=ENV, places=PLACES, start_step=8)
    started = time.monotonic()
    assert watch._agree_on_folder() == tmp_path / "hang-since-step8"
    assert time.monotonic() - started < 3


def test_each_nodes_line_names_the_nodes_none_of_whose_ranks_reported_and_the_step(tmp_path):
    env = DistEnv(rank=2, world_size=4, local_rank=0, local_world_size=2, device=torch.device("cpu"))
    watch = HangWatchdog(10, 600, output_dir=tmp_path, env=env, places=PLACES)
    watch.at(10, "summing the step's loss (all-reduce)")
    assert watch.lost_nodes([2, 3]) == [0] and watch.lost_nodes([0, 2, 3]) == []
    line = watch.node_line(12.4, 10, tmp_path, [2, 3], [0])
    assert line.startswith("meshtune: node 1: no optimizer step completed for 12 s at step 10 (hang timeout 10 s): "
                           "lost node 0 (a), none of whose ranks answered: a network partition"), line
    assert "rank(s) 1 did not report" in watch.node_line(12.4, 10, tmp_path, [0, 2, 3], [])


def test_no_timeout_until_the_first_step_is_done():
    assert watchdog(30).timeout() is None and watchdog(None).timeout() is None
    assert watchdog(30, durations=[100.0]).timeout() == 30


def test_the_automatic_timeout_is_five_median_steps_after_warm_up_between_a_floor_and_the_collective_timeout():
    assert watchdog(None, durations=[90.0] + [2.0] * 4).timeout() is None  # 4 steady steps: not yet
    assert watchdog(None, durations=[90.0] + [2.0] * 5).timeout() == 60  # 5 x 2 s is below the floor
    assert watchdog(None, durations=[90.0] + [20.0] * 5).timeout() == pytest.approx(100, abs=0.01)
    assert watchdog(None, ddp_timeout=100, durations=[90.0] + [20.0] * 5).timeout() == 80
    assert watchdog(None, durations=[90.0] + [200.0] + [20.0] * 300).timeout() == pytest.approx(100, abs=0.01)


def test_off_with_zero_or_on_one_process():
    assert not watchdog(0).enabled
    single = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    assert not HangWatchdog(30, 600, None, single, PLACES[:1]).enabled


def test_while_no_timeout_applies_rank_0_says_every_minute_that_a_step_is_still_running(caplog):
    caplog.set_level(logging.INFO, logger="meshtune")
    watch = HangWatchdog(None, 600, output_dir=None, env=ENV, places=PLACES)
    watch.at(1, "forward and backward, with the gradient reduction")
    watch._last = time.monotonic() - 59
    assert not watch._check() and caplog.messages == []
    watch._last = time.monotonic() - 61
    assert not watch._check() and not watch._check()  # once a minute, not once a look
    assert caplog.messages == ["meshtune: step 1 still running after 61 s, at: forward and backward, with the "
                               "gradient reduction"]
    watch._last = time.monotonic() - 125
    watch._check()
    assert len(caplog.messages) == 2 and caplog.messages[1].startswith("meshtune: step 1 still running after 125 s")
    for seconds in [90.0] + [2.0] * 5:  # five timed steps: the hang timeout applies, the notices stop
        watch._last = time.monotonic() - seconds
        watch.step_done()
    watch._last = time.monotonic() - 59
    assert watch.timeout() == 60 and not watch._check() and len(caplog.messages) == 2
    others = HangWatchdog(None, 600, None, DistEnv(1, 4, 1, 2, torch.device("cpu")), PLACES)
    off = HangWatchdog(0, 600, None, ENV, PLACES)
    for quiet in (others, off):
        quiet._last = time.monotonic() - 61
        quiet._check()
    assert len(caplog.messages) == 2 and not others.notices and not off.notices and not off.enabled


def test_a_slow_first_step_of_a_run_is_announced_while_it_runs(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                                                 tiny_dataset):
    from conftest import base_config
    from meshtune.config import build_config
    from meshtune.train import hang_watchdog
    from meshtune.train.loop import run

    monkeypatch.setattr(hang_watchdog, "SLOW_STEP_NOTICE_S", 0.2)
    monkeypatch.setattr(hang_watchdog, "CHECK_EVERY_S", 0.05)
    # every step sleeps after its optimizer step: a step slower than the notice is what the test is about
    monkeypatch.setenv("MESHTUNE_FAULT", "slow:0.5")
    run(build_config(base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2)))
    notices = [line for line in capsys.readouterr().out.splitlines() if "still running" in line]
    for step in (1, 2):  # a notice every 0.2 s; the 0.5 s sleep lies in the optimizer step's part
        pattern = rf"meshtune: step {step} still running after \d+ s, at: gradient clipping and optimizer step"
        assert any(re.search(pattern + "$", line) for line in notices), notices  # tqdm may move the cursor first


def test_the_straggler_warning_needs_the_same_rank_over_the_threshold_for_the_intervals_asked():
    times = StepTimes(ENV, PLACES, threshold=0.15, intervals=3)
    own, waits = [1.0, 1.0, 1.5, 1.0], [0.5, 0.5, 0.0, 0.5]
    assert times._warning(2, 0.5, own, 1.0, waits) is None
    assert times._warning(2, 0.5, own, 1.0, waits) is None
    warning = times._warning(2, 0.5, own, 1.0, waits)
    assert warning.startswith("warning: rank 2 (node 1, host b) is a straggler: its own work took 50% longer")
    assert times._warning(2, 0.5, own, 1.0, waits) is None  # said once, repeated only after 10 x 3 intervals
    assert times._warning(1, 0.5, own, 1.0, waits) is None  # another rank starts its own streak
    assert times._warning(1, 0.1, own, 1.0, waits) is None and times.streak == (-1, 0)  # under the threshold


def test_no_warning_when_the_threshold_is_zero():
    times = StepTimes(ENV, PLACES, threshold=0.0, intervals=1)
    assert times._warning(2, 5.0, [1.0, 1.0, 6.0, 1.0], 1.0, [5.0, 5.0, 0.0, 5.0]) is None


def test_a_main_thread_inside_torch_compile_is_not_hung():
    import threading

    from meshtune.train.hang_watchdog import main_thread_compiling

    def seen_from_the_watchdog_thread() -> bool:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(main_thread_compiling()))
        thread.start()
        thread.join()
        return seen[0]

    during = []

    def backend(graph, example_inputs):  # called by dynamo on the main thread, while it compiles
        during.append(seen_from_the_watchdog_thread())
        return graph.forward

    torch._dynamo.reset()
    assert torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(2)).tolist() == [3.0, 3.0]
    assert during == [True]
    assert not seen_from_the_watchdog_thread()


@pytest.mark.slow
def test_a_silent_rank_is_killed_by_a_worker_of_the_same_attempt_and_nothing_else_is():
    """This test stands in for torchrun's agent: its children are workers of attempt 1 (the reporting rank 0, a
    silent rank 1, a reporting rank 2) and a rank 1 left from attempt 0. Rank 0 kills the silent rank 1 of its own
    attempt only."""
    run_id = f"watch-test-{os.getpid()}"

    def worker(rank: int, attempt: int, code: str = "import time; time.sleep(60)") -> subprocess.Popen:
        env = {**os.environ, "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(attempt),
               "RANK": str(rank)}
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)

    silent, reporting, earlier = worker(1, 1), worker(2, 1), worker(1, 0)
    try:
        rank0 = worker(0, 1, "from meshtune.train.hang_watchdog import kill_silent_local_workers as kill\n"
                             "print(kill({1, 3}))")
        killed, _ = rank0.communicate(timeout=60)
        assert killed.strip() == str([(1, silent.pid)])
        assert silent.wait(timeout=10) == -9
        assert alive(reporting.pid) and alive(earlier.pid)
    finally:
        for process in (silent, reporting, earlier):
            kill_tree(process.pid)
            process.wait()
