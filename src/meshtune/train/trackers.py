"""`report_to`: which experiment trackers a run writes to besides metrics.jsonl, whether their packages are here
(checked before launch), the tracker runs a resumed run continues (output_dir/trackers.json), and `Trackers`, the
one object the metrics hand every record to. metrics.jsonl stays the record: a tracker that fails is dropped with
one warning, and training goes on."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from meshtune.config import TRACKERS, TrainConfig
from meshtune.errors import ConfigError
from meshtune.train.sinks import SINKS, Sink

if TYPE_CHECKING:  # the launcher checks the trackers' packages without the training stack
    from meshtune.checkpoint.object_store import StorePath
    from meshtune.plan import RunPlan

logger = logging.getLogger(__name__)
IDENTITIES = "trackers.json"
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}  # tracker -> (module imported, package on PyPI)


def installed(tracker: str) -> bool:
    return importlib.util.find_spec(PACKAGES[tracker][0]) is not None


def selected(report_to: list[str]) -> list[str]:
    """The trackers `report_to` names; `all`: those installed."""
    return [name for name in TRACKERS if installed(name)] if report_to == ["all"] else report_to


def check_installed(report_to: list[str]) -> None:
    """Before launch: every tracker named has its package here, or a named error with the pip command."""
    missing = [name for name in report_to if name != "all" and not installed(name)]
    if missing:
        packages = " ".join(PACKAGES[name][1] for name in missing)
        raise ConfigError(f"report_to: {', '.join(report_to)} needs {' and '.join(missing)}, not installed here: "
                          f"pip install 'meshtune[{','.join(missing)}]' (or pip install {packages}), or leave "
                          f"{' and '.join(missing)} out of report_to")


class Trackers:
    """Rank 0's trackers: each record, the run's description and its events go to every sink. A sink that raises
    is dropped with one warning naming it; metrics.jsonl keeps every record."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, record: dict) -> None:
        """A metrics.jsonl record: its numbers as metrics, its texts (a straggler's host) as text, at its step."""
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        texts = {k: v for k, v in record.items() if isinstance(v, str)}
        self._each(f"logging step {record['step']}", lambda sink: sink.log(record["step"], numbers, texts))

    def describe(self, description: dict[str, dict]) -> None:
        self._each("taking the config and run plan", lambda sink: sink.describe(description))

    def event(self, step: int, name: str, text: str) -> None:
        self._each(f"logging {name}", lambda sink: sink.event(step, name, text))

    def checkpoint_published(self, step: int, path: Path) -> None:
        self.event(step, "checkpoint", f"{path.name} published ({path})")

    def close(self, finished: bool) -> None:
        """`finished`: the run logged its last step (else it stopped early, to resume)."""
        self._each("closing", lambda sink: sink.close(finished))
        self.sinks = []

    def _each(self, doing: str, call: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as error:  # a tracker never stops training
                self.sinks.remove(sink)
                logger.warning(f"warning: {sink.name} failed {doing} ({type(error).__name__}: {error}); nothing more "
                               f"goes to {sink.name} in this run, output_dir/metrics.jsonl keeps every record")
                with contextlib.suppress(Exception):  # its files and threads released, if it still can
                    sink.close(finished=False)


def open_trackers(cfg: TrainConfig, plan: RunPlan, start_step: int, enabled: bool, store: StorePath | None = None
                  ) -> Trackers:
    """Rank 0 (`enabled`): the trackers `report_to` selects, each continuing the run trackers.json names when this
    run resumes at `start_step` (else a new one), given the config and the run plan; a resume is an event. A
    tracker that cannot start is left out with a warning. Elsewhere, and with report_to none: none. With checkpoints
    in an object store (`store`), trackers.json is kept there too: a resume on fresh nodes continues the same runs."""
    names = selected(cfg.report_to) if enabled else []
    if enabled and cfg.report_to == ["all"] and not names:
        logger.warning(f"warning: report_to: all finds none of {', '.join(TRACKERS)} installed; metrics go to "
                       f"output_dir/metrics.jsonl only")
    if not names:
        return Trackers([])
    output_dir = Path(cfg.output_dir)
    if start_step and store is not None and not (output_dir / IDENTITIES).is_file():
        fetch_identities(store / IDENTITIES, output_dir / IDENTITIES)
    known = read_identities(output_dir) if start_step else {}
    sinks = []
    for name in names:
        try:
            sinks.append(SINKS[name](output_dir, known.get(name), start_step, output_dir.resolve().name))
        except Exception as error:
            logger.warning(f"warning: {name} could not start ({type(error).__name__}: {error}); the run goes on "
                           f"without it, output_dir/metrics.jsonl keeps every record")
    (output_dir / IDENTITIES).write_text(json.dumps({**known, **{s.name: s.identity for s in sinks}}, indent=1))
    if store is not None:
        keep_identities(output_dir / IDENTITIES, store / IDENTITIES)
    trackers = Trackers(sinks)
    trackers.describe({"config": cfg.model_dump(), "run_plan": asdict(plan)})
    if start_step:
        trackers.event(start_step, "resumed_from", f"resumed from {plan.resumed_from} at step {start_step}")
    return trackers


def fetch_identities(source: StorePath, target: Path) -> None:
    """The store's trackers.json, where this node's output_dir has none (a resume on fresh nodes)."""
    try:
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    except Exception as error:  # the store's client raises its own kinds
        logger.warning(f"warning: could not read {source} ({type(error).__name__}: {error}); the trackers start new "
                       f"runs")


def keep_identities(source: Path, target: StorePath) -> None:
    """trackers.json copied to the store beside the checkpoints."""
    try:
        target.write_bytes(source.read_bytes())
    except Exception as error:
        logger.warning(f"warning: could not write {target} ({type(error).__name__}: {error}); a resume on other "
                       f"nodes starts new tracker runs")


def read_identities(output_dir: Path) -> dict[str, dict]:
    """The tracker runs of the run this one resumes: none where it kept none (or resumes another output_dir's)."""
    path = output_dir / IDENTITIES
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        logger.warning(f"warning: {path} is not JSON; the trackers start new runs")
        return {}
