"""Shared fixtures: a tiny local model + tokenizer + dataset (nothing downloaded), and a CLI runner that
always cleans up every process it started."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

# one intra-op thread for this process and every process a test starts (torchrun sets it only where a node has
# several processes): the suite runs more processes than the machine has cores, and a thread a core each
# oversubscribes them, where OpenMP's spinning threads stall the CPU collectives of a two-node job for seconds a
# step. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from meshtune.cli import COMMAND_GC_THRESHOLD  # noqa: E402

# the tests' own processes import torch, transformers and peft and build models in-process: collected as rarely as
# meshtune's commands are, not every 700 new objects
gc.set_threshold(*COMMAND_GC_THRESHOLD)

REPO = Path(__file__).resolve().parents[1]
# the repo's copy of LLaMA-Factory's demo data (dpo_en_demo, kto_en_demo, ...) with its dataset_info.json
LLAMAFACTORY_DATA = REPO / "tests" / "fixtures" / "compat" / "llamafactory" / "data"
sys.path.insert(0, str(REPO / "bench"))  # the bench scripts' process-tree helpers serve the tests too

from meshtune.demo.model import build_tiny_model  # noqa: E402
from meshtune.demo.tokenizer import train_tokenizer  # noqa: E402
from processes import kill_tree  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rain, "
         "sun and wind in the green valley near our old house").split()


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    tokenizer = train_tokenizer([sentence(rng, 5, 30) for _ in range(300)], vocab_size=320)
    return build_tiny_model(tokenizer, tmp_path_factory.mktemp("model"), seed=0,
                            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """64 conversations in the messages format, of varied lengths, some multi-turn with a system prompt."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for i in range(64):
            messages = [{"role": "system", "content": sentence(rng, 2, 5)}] if i % 4 == 0 else []
            for _ in range(1 + (i % 3 == 0)):
                messages += [{"role": "user", "content": sentence(rng, 2, 12)},
                             {"role": "assistant", "content": sentence(rng, 1, 10)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(autouse=True)
def meshtune_console():
    """meshtune's records on the console as its commands show them (`meshtune.cli.main` configures the same), so a
    test that calls the training code itself reads its lines with capsys. Taken down after each test, with the
    capture of Python warnings a command under test turned on."""
    import logging

    from meshtune import logs

    logger = logging.getLogger("meshtune")
    logger.addHandler(logs.ConsoleHandler(logs.RankFilter()))
    logger.setLevel(logging.INFO)
    yield
    logging.captureWarnings(False)
    for name in ("meshtune", "py.warnings"):
        for handler in [h for h in logging.getLogger(name).handlers if isinstance(h, logs.ConsoleHandler)]:
            logging.getLogger(name).removeHandler(handler)
    logger.setLevel(logging.NOTSET)


# `make test` runs four pytest-xdist workers, each taking a whole module at a time (`--dist loadscope`: a module's
# fixtures, such as the fault tests' shared jobs, are built once), in the order below (`--no-loadscope-reorder`):
# the longest modules first, by their seconds in the table a run ends with (ModuleTimes below; 2026-12-07, three
# workers on 2 cores), so that the workers end together. test_demo.py's is short, but its demo runs `alone`.
LONGEST_MODULES_FIRST = ("test_faults.py", "test_bench.py", "test_qlora.py", "test_pipeline_parallel.py",
                         "test_node_exits.py", "test_rendezvous_checks.py", "test_tensor_parallel.py", "test_doctor.py",
                         "test_partition.py", "test_compat.py", "test_object_store.py", "test_fast_path.py",
                         "test_counter_dropout.py", "test_rendezvous_churn.py", "test_slurm.py", "test_topology.py",
                         "test_dpo_precompute_nodes.py", "test_recompute.py", "test_scheduler_files.py",
                         "test_restarts.py", "test_checkpoint.py", "test_chat.py", "test_loop_options.py",
                         "test_demo.py")


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # a serial run keeps pytest's own order
        return
    order = {name: i for i, name in enumerate(LONGEST_MODULES_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each module's own order kept


class ModuleTimes:
    """What the order above is kept true by: under pytest-xdist, each module's seconds (setup, call and teardown of
    its tests) and the worker that ran it, and when each worker finished, printed at the end of the run."""

    def __init__(self):
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.worker: dict[str, str] = {}
        self.ended: dict[str, float] = {}

    def add(self, report) -> None:
        worker = getattr(getattr(report, "node", None), "gateway", None)  # set by xdist on the controller's copy
        if worker is None:
            return
        module = report.nodeid.split("::")[0]
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration
        self.worker[module] = worker.id
        self.ended[worker.id] = time.monotonic() - self.started

    def lines(self, shown: int = 25) -> list[str]:
        ranked = sorted(self.seconds.items(), key=lambda item: -item[1])
        lines = [f"{seconds:8.1f}s  {self.worker[module]}  {module}" for module, seconds in ranked[:shown]]
        for worker, ended in sorted(self.ended.items()):
            busy = sum(s for m, s in self.seconds.items() if self.worker[m] == worker)
            lines.append(f"{worker}: its last test ended {ended:.0f} s into the run, {busy:.0f} s in tests")
        return lines


MODULE_TIMES = ModuleTimes()


def pytest_runtest_logreport(report):
    MODULE_TIMES.add(report)


def pytest_terminal_summary(terminalreporter):
    if MODULE_TIMES.seconds:
        terminalreporter.write_sep("=", "seconds by module, and each worker's end (tests/conftest.py)")
        for line in MODULE_TIMES.lines():
            terminalreporter.write_line(line)


class WorkerLock:
    """Shared by the pytest-xdist workers of one run: a test marked `alone` (one that times itself or its steps
    against the clock) runs with no other test beside it; the others run side by side."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.gate = (directory / "gate.lock").open("a")
        self.tests = (directory / "tests.lock").open("a")

    @contextlib.contextmanager
    def hold(self, alone: bool):
        fcntl.flock(self.gate, fcntl.LOCK_EX)  # an `alone` test waiting here keeps the next tests from starting
        try:
            fcntl.flock(self.tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.tests, fcntl.LOCK_UN)

    def share(self) -> None:
        """The `alone` test holding the machine has timed all it times: its rest runs beside other tests (and still
        keeps another `alone` test from starting)."""
        fcntl.flock(self.tests, fcntl.LOCK_SH)


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes the temp folders
def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker; its lock files in the run's shared temp folder
        config.worker_lock = WorkerLock(config._tmp_path_factory.getbasetemp().parent / "worker-locks")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around a test's setup, call and teardown (a module's fixtures, and the side jobs it waits for, included)."""
    lock = getattr(item.config, "worker_lock", None)
    RUNNING["item"] = item
    try:
        with lock.hold(item.get_closest_marker("alone") is not None) if lock else contextlib.nullcontext():
            yield
    finally:
        RUNNING["item"] = None


@pytest.fixture
def untimed_from_here(request):
    """For a test marked `alone`: `untimed_from_here()` once what it times against the clock is over; what is left
    (a relaunch, the comparison with a reference run) runs beside other tests under pytest-xdist."""
    lock = getattr(request.config, "worker_lock", None)
    return lock.share if lock is not None else lambda: None


# `make test-fast` runs the tests not marked `slow`; a test that starts a process (a subprocess, a multiprocessing
# rank, torchrun) must carry the marker, or the fast tier would pay for it. Starting one, in the test or in a fixture
# it sets up, is recorded here and fails the test at its end, naming what it started.
RUNNING: dict = {"item": None}


def record_process_start(what: str) -> None:
    item = RUNNING["item"]
    if item is not None and item.get_closest_marker("slow") is None:
        item.stash.setdefault(UNMARKED_STARTS, []).append(what)


UNMARKED_STARTS = pytest.StashKey[list]()


def watch_process_starts() -> None:
    import multiprocessing.process

    execute_child = subprocess.Popen._execute_child
    start = multiprocessing.process.BaseProcess.start

    def recorded_execute_child(self, args, *rest, **kwargs):
        record_process_start(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:120]}")
        return execute_child(self, args, *rest, **kwargs)

    def recorded_start(self):
        record_process_start(f"multiprocessing {getattr(self, '_target', None)}")
        return start(self)

    subprocess.Popen._execute_child = recorded_execute_child
    multiprocessing.process.BaseProcess.start = recorded_start


watch_process_starts()


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request):
    yield
    started = request.node.stash.get(UNMARKED_STARTS, [])
    assert not started, (f"{request.node.nodeid} starts processes but is not marked slow "
                         f"(@pytest.mark.slow): {started[:3]}")


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skips a test, or one of its parameters, on a machine with fewer than `count` CUDA GPUs."""
    import torch

    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} CUDA GPUs")


def write_config(directory: Path, **values) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def base_config(model_dir: Path, dataset: Path, output_dir: Path, **extra) -> dict:
    values = dict(model_name_or_path=str(model_dir), dataset=str(dataset), output_dir=str(output_dir),
                  finetuning_type="lora", lora_rank=4, lora_dropout=0.0, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, learning_rate=5e-3, max_steps=5, logging_steps=1,
                  cutoff_len=64, seed=7, parallel="ddp", nproc_per_node=1,
                  plot_loss=False)  # matplotlib's import, a second of CPU a run; tests of loss.png turn it on
    values.update(extra)
    return values


def run_cli(args: list[str], timeout: float = 240, cwd: Path | None = None, env: dict | None = None):
    """`python -m meshtune ARGS` with a hard timeout; every process it started is killed on the way out."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "meshtune", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=cwd, env=full_env)
    started = time.monotonic()
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        pytest.fail(f"meshtune {' '.join(args)} did not finish in {timeout} s:\n{output[-4000:]}")
    finally:
        kill_tree(process.pid)
    return subprocess.CompletedProcess(args, process.returncode, output, None), time.monotonic() - started


HEAVY_LIBRARIES = ("torch", "transformers")
IMPORTED = "imported:"
RUN_AND_LIST_IMPORTS = f"""
import sys
from meshtune.cli import main
code = main(sys.argv[1:])
print({IMPORTED!r}, *[name for name in {HEAVY_LIBRARIES!r} if name in sys.modules])
raise SystemExit(code)
"""


def heavy_imports_of(args: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`meshtune ARGS` in a fresh process, and which of torch and transformers it imported (read from sys.modules
    as it ends: `-X importtime` misses what importlib.import_module loads). stdout without that last line."""
    process = subprocess.run([sys.executable, "-c", RUN_AND_LIST_IMPORTS, *args], capture_output=True, text=True,
                             timeout=60, env=env)
    *lines, last = process.stdout.splitlines() or [""]
    assert last.startswith(IMPORTED), process.stdout[-3000:] + process.stderr[-3000:]
    process.stdout = "".join(f"{line}\n" for line in lines)
    return process, last.split()[1:]


def run_cli_here(args: list[str], capfd) -> subprocess.CompletedProcess:
    """`meshtune ARGS` through `meshtune.cli.main` in this process: the code path of `run_cli` without a Python
    start-up (seconds of imports), for a command that stops early (an error, --help) or trains on one process
    (which then trains here). stdout then stderr in one text, as `run_cli` merges them; capfd also holds what any
    process it started printed."""
    from meshtune.cli import main

    capfd.readouterr()  # only this command's output
    try:
        code = main(args)
    except SystemExit as exc:  # argparse: --help, a bad option
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    captured = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out + captured.err, None)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
