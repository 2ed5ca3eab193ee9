"""The experiment trackers a run writes to besides metrics.jsonl, one class each: TensorBoard (torch's
SummaryWriter), W&B and MLflow. Each starts its run, or reopens the one a resumed run continues from `identity`
(what output_dir/trackers.json keeps), and takes the run's description (config and run plan), each record's numbers
and texts under metrics.jsonl's names, and events (a checkpoint published, a resume). Their packages are imported
here only, when `report_to` asks for them.

A run resumed from checkpoint N logs the steps after N again. TensorBoard drops what a crashed run had logged after
N (`purge_step`), as metrics.jsonl does; a W&B or MLflow run cannot drop a step, so there the steps it holds already
are not logged twice (the resumed run computes the same losses for them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

PARAM_CHARS = 500  # MLflow's shortest limit on a parameter's value across its versions


class Sink(Protocol):
    name: str
    identity: dict[str, Any]  # what reopening this run needs, kept in output_dir/trackers.json

    def describe(self, description: dict[str, dict]) -> None: ...

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None: ...

    def event(self, step: int, name: str, text: str) -> None: ...

    def close(self, finished: bool) -> None: ...


class TensorBoardSink:
    """Event files in output_dir/tensorboard/<start time>/, flushed after every record so a crash loses none."""

    name = "tensorboard"

    def __init__(self, output_dir: Path, identity: dict | None, start_step: int, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = identity["log_dir"] if identity else f"tensorboard/{time.strftime('%Y%m%d-%H%M%S')}"
        # readers drop the events at or after purge_step that earlier files of the log dir hold: the steps a
        # crashed run logged after the checkpoint this run resumes (its own step N stays, as in metrics.jsonl)
        self.writer = SummaryWriter(str(output_dir / log_dir), purge_step=start_step + 1 if identity else None)
        self.start_step = start_step
        self.identity = {"log_dir": log_dir}

    def describe(self, description: dict[str, dict]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for key, value in description.items():  # indented: a code block in TensorBoard's markdown
            self.writer.add_text(key, "\n".join("    " + line for line in json.dumps(value, indent=1).splitlines()),
                                 self.start_step)
        flat = {key: value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
                for key, value in flatten(description).items()}
        for summary in hparams(flat, {"loss": 0, "eval_loss": 0}):  # the HPARAMS view: this run, its losses
            self.writer.file_writer.add_summary(summary, self.start_step)
        self.writer.flush()

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)
        for key, value in texts.items():
            self.writer.add_text(key, value, step)
        self.writer.flush()

    def event(self, step: int, name: str, text: str) -> None:
        self.writer.add_scalar(name, step, step)
        self.writer.add_text(name, text, step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in project WANDB_PROJECT (default meshtune), named by output_dir, its files in output_dir/wandb/;
    WANDB_MODE=offline keeps it there for `wandb sync`."""

    name = "wandb"

    def __init__(self, output_dir: Path, identity: dict | None, start_step: int, run_name: str):
        import wandb

        project = identity["project"] if identity else os.environ.get("WANDB_PROJECT") or "meshtune"
        # create_new: this run object only, whatever other run the process holds
        self.run = wandb.init(dir=str(output_dir), project=project, name=run_name, reinit="create_new",
                              id=identity["id"] if identity else None, resume="allow" if identity else None)
        # W&B keeps a run's steps increasing: the steps a resumed run holds on the server are below this (an
        # offline run knows none: `wandb sync` keeps the first file's)
        self.floor = self.run.step
        self.identity = {"id": self.run.id, "project": project}

    def describe(self, description: dict[str, dict]) -> None:
        self.run.config.update(description, allow_val_change=True)  # a resume's plan replaces the first

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        if step < self.floor:
            return
        self.run.log({**numbers, **texts}, step=step)
        self.floor = step

    def event(self, step: int, name: str, text: str) -> None:
        self.run.log({name: step}, step=max(step, self.floor))  # a save published late joins the current step

    def close(self, finished: bool) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default meshtune), named by output_dir, in the store at
    MLFLOW_TRACKING_URI, else in a file store in output_dir/mlruns/, which MLflow 3 opens only with
    MLFLOW_ALLOW_FILE_STORE=true (README: "Looking at meshtune's MLflow runs")."""

    name = "mlflow"

    def __init__(self, output_dir: Path, identity: dict | None, start_step: int, run_name: str):
        from mlflow.entities import RunStatus
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps its file store for those who ask for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (output_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        run = None
        if identity:
            try:
                run = self.client.get_run(identity["run_id"])
            except MlflowException:  # not in this store (MLFLOW_TRACKING_URI changed): a new run
                pass
        if run is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "meshtune"
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=run_name)
        self.run_id = run.info.run_id
        # the last step the run holds: a resumed run logs only the steps after it
        self.logged_up_to = max((m.step for key in run.data.metrics
                                 for m in self.client.get_metric_history(self.run_id, key)), default=-1)
        self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self.identity = {"run_id": self.run_id, "tracking_uri": uri}

    def describe(self, description: dict[str, dict]) -> None:
        from mlflow.entities import Param

        held = self.client.get_run(self.run_id).data.params  # a parameter, once logged, keeps its value
        params = [Param(key, (value if isinstance(value, str) else json.dumps(value))[:PARAM_CHARS])
                  for key, value in flatten(description).items() if key not in held]
        for start in range(0, len(params), 100):  # MLflow's most parameters a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        for key, value in description.items():  # whole, as artifacts: a resume's replace the first
            self.client.log_dict(self.run_id, value, f"{key}.json")

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        from mlflow.entities import Metric, RunTag

        if step <= self.logged_up_to:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step) for key, value in
                                                    numbers.items()],
                              tags=[RunTag(key, value) for key, value in texts.items()])

    def event(self, step: int, name: str, text: str) -> None:
        from mlflow.entities import Metric, RunTag

        self.client.log_batch(self.run_id, metrics=[Metric(name, float(step), int(time.time() * 1000), step)],
                              tags=[RunTag(name, text)])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"config": {"learning_rate": 1e-4}} as {"config.learning_rate": 1e-4}: trackers' parameters are flat."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
