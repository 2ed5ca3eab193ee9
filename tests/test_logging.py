"""meshtune's logging: the `meshtune` logger tree, the console the commands configure, the rank filter, Python
warnings of the ranks other than 0, and a user's own handlers."""

from __future__ import annotations

import ast
import logging
import re
import warnings
from pathlib import Path

import pytest

from conftest import base_config, read_metrics, run_cli_here, write_config
from meshtune import logs
from meshtune.checkpoint import manager
from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.logs import RankWarning
from ranks import run_workers

SRC = Path(__file__).resolve().parents[1] / "src" / "meshtune"
RNG_WARNING = "rank 1: checkpoint-2 was saved by 1 ranks and holds no random state for this rank"


def as_rank(monkeypatch, rank: int) -> None:
    """This process seen as torchrun's worker of global rank `rank` (no process group formed)."""
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("RANK", str(rank))


def record(level: int = logging.INFO, name: str = "meshtune.train.loop", text: str = "a line") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, text, None, None)


def rank_warning_record(text: str = RNG_WARNING) -> logging.LogRecord:
    return record(logging.WARNING, "py.warnings", warnings.formatwarning(text, RankWarning, manager.__file__, 242))


def test_rank_0_alone_speaks_by_default_and_every_rank_with_a_level_for_all(monkeypatch):
    default, everyone = logs.RankFilter(logging.INFO), logs.RankFilter(logging.INFO, all_ranks=logging.WARNING)
    assert default.filter(record()) and everyone.filter(record())
    assert not default.filter(record(logging.DEBUG))
    as_rank(monkeypatch, 1)
    assert not default.filter(record()) and not default.filter(record(logging.WARNING))
    assert everyone.filter(record(logging.WARNING)) and not everyone.filter(record(logging.INFO))
    monkeypatch.delenv("LOCAL_RANK")  # RANK alone (a PyTorchJob pod's index) makes no rank: a launcher speaks
    assert default.filter(record())


def test_the_console_tags_another_ranks_lines_when_the_environment_lets_every_rank_speak(monkeypatch, capsys):
    log = logging.getLogger("meshtune.train.loop")
    as_rank(monkeypatch, 1)
    logs.configure()
    log.info("resumed from checkpoint-2\nat step 2")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(logs.ALL_RANKS_ENV, "info")
    logs.configure()
    log.info("resumed from checkpoint-2\nat step 2")
    log.debug("not at info")
    assert capsys.readouterr().out == "[rank 1] resumed from checkpoint-2\n[rank 1] at step 2\n"
    monkeypatch.setenv(logs.ALL_RANKS_ENV, "loud")
    with pytest.raises(ConfigError, match=rf"{logs.ALL_RANKS_ENV}: 'loud' is not a log level; use one of debug, "):
        logs.configure()


def test_the_config_key_lets_every_rank_speak_and_is_checked(monkeypatch, capsys, tmp_path):
    assert build_config({"model_name_or_path": "m", "dataset": "d.json",
                         "log_level_all_ranks": "warning"}).log_level_all_ranks == "warning"
    with pytest.raises(ConfigError, match="log_level_all_ranks"):
        build_config({"model_name_or_path": "m", "dataset": "d.json", "log_level_all_ranks": "loud"})
    as_rank(monkeypatch, 1)
    logs.configure()
    logs.show_all_ranks("warning")
    logging.getLogger("meshtune.train.nonfinite").warning("warning: step 3: the loss was not finite")
    logging.getLogger("meshtune.train.loop").info("an info line")
    assert capsys.readouterr().out == "[rank 1] warning: step 3: the loss was not finite\n"


def test_a_warning_only_rank_1_sees_reaches_the_console_once_tagged_while_library_warnings_stay_with_rank_0(
        monkeypatch, capsys):
    as_rank(monkeypatch, 1)
    logs.configure()
    for _ in range(2):  # no registry: Python itself would show it each time
        warnings.warn_explicit(RNG_WARNING, RankWarning, manager.__file__, 242)
    warnings.warn_explicit("`broadcast_buffers` is deprecated", FutureWarning, "/torch/nn/parallel/distributed.py", 9)
    lines = capsys.readouterr().err.splitlines()
    shown = warnings.formatwarning(RNG_WARNING, RankWarning, manager.__file__, 242)  # with its source line
    assert lines == [f"[rank 1] {line}" for line in shown.rstrip("\n").split("\n")]
    assert lines[0] == f"[rank 1] {manager.__file__}:242: RankWarning: {RNG_WARNING}"
    as_rank(monkeypatch, 0)
    warnings.warn_explicit("`broadcast_buffers` is deprecated", FutureWarning, "/torch/nn/parallel/distributed.py", 9)
    assert capsys.readouterr().err == "/torch/nn/parallel/distributed.py:9: FutureWarning: `broadcast_buffers` is " \
                                      "deprecated\n"  # as Python prints it: one line, no tag


def test_rank_warnings_are_told_apart_by_their_category_and_each_message_passes_once(monkeypatch):
    as_rank(monkeypatch, 2)
    rank_filter = logs.RankFilter()
    assert rank_filter.filter(rank_warning_record()) and not rank_filter.filter(rank_warning_record())
    assert rank_filter.filter(rank_warning_record("rank 2: another message"))
    user_warning = warnings.formatwarning(RNG_WARNING, UserWarning, manager.__file__, 242)
    assert not rank_filter.filter(record(logging.WARNING, "py.warnings", user_warning))
    assert not rank_filter.filter(record(logging.WARNING, "meshtune.x", f"x.py:1: RankWarning: {RNG_WARNING}"))


def test_a_handler_of_the_users_own_on_meshtune_gets_every_rank_and_the_root_logger_is_left_alone(monkeypatch,
                                                                                                    capsys):
    from meshtune.launch.supervise import check_cpu_processes

    root_handlers = list(logging.getLogger().handlers)
    logs.configure()
    assert logging.getLogger().handlers == root_handlers and logging.getLogger("meshtune").propagate

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    mine, rank0_only = Kept(), Kept()
    rank0_only.addFilter(logs.RankFilter())
    meshtune_logger = logging.getLogger("meshtune")
    monkeypatch.setattr(meshtune_logger, "handlers", [mine, rank0_only])  # the user's instead of the console
    check_cpu_processes(8, cores=4, cuda=False)
    as_rank(monkeypatch, 3)
    check_cpu_processes(8, cores=4, cuda=False)
    assert [(r.name, r.levelname) for r in mine.records] == [("meshtune.launch.supervise", "WARNING")] * 2
    assert mine.records[0].getMessage().startswith("warning: nproc_per_node 8 is more than this machine's 4 CPU")
    assert len(rank0_only.records) == 1
    meshtune_logger.setLevel(logging.ERROR)  # the user's level holds
    check_cpu_processes(8, cores=4, cuda=False)
    assert len(mine.records) == 2 and capsys.readouterr().out == ""


def test_log_level_on_the_command_line_and_in_the_environment(tmp_path, tiny_model_dir, tiny_dataset, capfd,
                                                                monkeypatch):
    config = write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2,
                                                  save_final=False, nproc_per_node=2))
    dry = run_cli_here(["launch", "--dry-run", str(config), "--log-level", "warning"], capfd)
    assert dry.returncode == 0 and "-m meshtune train --log-level warning " in dry.stdout  # the workers' level
    dry = run_cli_here(["--debug", "launch", "--dry-run", str(config)], capfd)
    assert dry.returncode == 0 and "-m meshtune train --log-level debug " in dry.stdout  # --debug: debug
    one = str(write_config(tmp_path, **base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2,
                                                   save_final=False)))
    quiet = run_cli_here(["train", one, "--log-level", "warning"], capfd)
    assert quiet.returncode == 0 and "chat template:" not in quiet.stdout and "run plan" not in quiet.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]
    shown = run_cli_here(["train", one, "output_dir=" + str(tmp_path / "again")], capfd)
    assert shown.returncode == 0 and "chat template:" in shown.stdout and "run plan" in shown.stdout
    monkeypatch.setenv(logs.LEVEL_ENV, "verbose")
    refused = run_cli_here(["train", one], capfd)
    assert refused.returncode == 1
    assert f"meshtune: error: {logs.LEVEL_ENV}: 'verbose' is not a log level; use one of debug, info, warning, " \
           "error" in refused.stdout


def test_hf_log_level_replica_becomes_the_level_of_every_rank(tmp_path):
    from meshtune.compat.job_config import load_job_config

    def loaded(value: str):
        path = tmp_path / "hf.yaml"
        path.write_text(f"model_name_or_path: m\ndataset: d.json\nlog_level_replica: {value}\n")
        return load_job_config(str(path), [], {}).config.log_level_all_ranks

    assert loaded("info") == "info" and loaded("critical") == "error" and loaded("passive") is None


def test_no_log_callable_is_passed_through_the_code():
    """meshtune's modules log to their own loggers: no function takes a `log` parameter, no call passes `log=`."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args
                names = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
                found += [f"{path.relative_to(SRC)}:{node.lineno} parameter {name}" for name in names
                          if name == "log"]
            if isinstance(node, ast.Call):
                found += [f"{path.relative_to(SRC)}:{node.lineno} {kw.arg}=" for kw in node.keywords if kw.arg == "log"]
    assert not found, found
    assert len(list(SRC.rglob("*.py"))) > 50  # the scan saw the package


@pytest.mark.slow
def test_a_rank_without_random_state_in_the_checkpoint_says_so_and_log_level_all_ranks_lets_it_say_more(
        tmp_path, tiny_model_dir, tiny_dataset):
    """Saved by 1 process, resumed on 2: rank 1 finds no random state of its own, and only it can say so."""
    from meshtune.train.loop import run

    values = base_config(tiny_model_dir, tiny_dataset, tmp_path / "out", max_steps=2, save_steps=2, save_final=False)
    run(build_config(values))
    resume = write_config(tmp_path, **{**values, "max_steps": 3, "save_steps": 3, "nproc_per_node": 2,
                                       "resume_allow_changed": ["max_steps"]})
    codes, output = run_workers(["train", str(resume)], 2, tmp_path / "ranks", timeout=180)
    assert codes == [0, 0], output[-4000:]
    rank0, rank1 = output.split("--- rank 1\n")
    assert "resumed from" in rank0 and "resumed from" not in rank1  # rank 1's info stays with it
    warned = [line for line in rank1.splitlines() if re.search(r"\.py:\d+: \w+Warning: ", line)]  # libraries': rank 0's
    assert len(warned) == 1 and warned[0].startswith("[rank 1] ") and f"RankWarning: {RNG_WARNING}; " in warned[0]
    assert RNG_WARNING not in rank0

    more = write_config(tmp_path, **{**values, "max_steps": 4, "save_steps": 4, "nproc_per_node": 2,
                                     "resume_allow_changed": ["max_steps"], "log_level_all_ranks": "info"})
    codes, output = run_workers(["train", str(more)], 2, tmp_path / "ranks-all", timeout=180)
    assert codes == [0, 0], output[-4000:]
    rank1 = output.split("--- rank 1\n")[1]
    assert "[rank 1] resumed from " in rank1 and "[rank 1] lora on 2 process(es): 4 steps" in rank1
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3, 4]
