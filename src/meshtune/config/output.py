"""Outputs, evaluation and checkpoints (where the run writes, what it logs and to which trackers, when it evaluates,
saves and resumes); and how stragglers and hangs are watched."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from meshtune.config.section import JOB, NODE, Keys, Section, split_commas

OUTPUT = Section("outputs, evaluation and checkpoints", JOB)
WATCH = Section("stragglers and hangs", JOB)
TRACKERS = ("tensorboard", "wandb", "mlflow")  # report_to's trackers (train/sinks.py)
# the other trackers HF's and LLaMA-Factory's report_to know
OTHER_TRACKERS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "neptune", "swanlab",
                  "trackio")


class OutputKeys(Keys):
    output_dir: str = OUTPUT("output", "where metrics.jsonl, config.yaml, run_plan.json, loss.png, checkpoints and "
                                       "final/ go; shared storage across nodes (checked at start)", scope=NODE)
    logging_steps: int = OUTPUT(10, "log (and write metrics.jsonl) every N optimizer steps; the ranks compare their "
                                    "step times then (a collective), so it is the same on every node", gt=0)
    report_to: list[str] = OUTPUT([], "experiment trackers that also get every metrics record, the config and run "
                                      "plan, and checkpoint events (global rank 0 writes; metrics.jsonl stays the "
                                      "record): tensorboard (output_dir/tensorboard/) | wandb (W&B; WANDB_MODE=offline "
                                      "keeps it in output_dir/wandb/) | mlflow (a store in output_dir/mlruns/, or "
                                      "MLFLOW_TRACKING_URI) | a list of them | all (every one installed) | none. A "
                                      "resumed run continues the same tracker runs. Each needs its package: pip "
                                      "install 'meshtune[tensorboard]' (or wandb, mlflow; trackers for all three)",
                                  scope=NODE)
    per_device_eval_batch_size: int = OUTPUT(8, "samples per process per evaluation step", gt=0)
    eval_strategy: Literal["steps", "epoch", "no"] = OUTPUT(
        "steps", "with val_size or eval_dataset, when to evaluate: steps (every eval_steps, and at the end) | epoch "
                 "(at the end of every epoch, and at the end) | no (only at the end)")
    eval_steps: int | None = OUTPUT(None, "evaluate every N steps (default: only at the end); needs val_size or "
                                          "eval_dataset", gt=0)
    save_final: bool = OUTPUT(True, "write the trained model (or LoRA adapter) to output_dir/final at the end; false "
                                    "for throughput runs and smoke tests, where only the metrics matter")
    plot_loss: bool = OUTPUT(True, "draw output_dir/loss.png (train and eval loss by step) at the end of the run; "
                                   "false leaves it out, and with it matplotlib's import (about a second of CPU) from "
                                   "every run: smoke tests, sweeps of short runs")
    save_strategy: Literal["steps", "epoch", "no"] = OUTPUT(
        "steps", "when to write sharded checkpoints: steps (every save_steps) | epoch (at the end of every epoch and "
                 "at the last step; save_steps is not read) | no (none: only final/)")
    save_steps: int = OUTPUT(0, "save_strategy steps: write a sharded checkpoint every N optimizer steps and at the "
                                "last one (0 = only final/)", ge=0)
    save_total_limit: int | None = OUTPUT(None, "complete checkpoints to keep (the newest is never deleted); "
                                                "default: all", gt=0)
    async_save: bool = OUTPUT(False, "write checkpoints in the background while training continues (one at a time); "
                                     "turn on when saving stalls training")
    stop_grace_period: int = OUTPUT(60, "seconds a SIGTERM (what SLURM, Kubernetes and other schedulers send before "
                                        "preempting) leaves the job: every process finishes the step in progress and "
                                        "the next, a checkpoint is written if the last save's duration fits in what is "
                                        "left, and the job exits with 143 (128 + SIGTERM, retryable) to resume from "
                                        "there when relaunched. 0: stop after the step without saving. Give the "
                                        "scheduler at least this long between its SIGTERM and SIGKILL", ge=0)
    resume_allow_changed: list[str] = OUTPUT([], "keys of the run's math that may differ from the checkpoint being "
                                                 "resumed, e.g. max_steps to train further or learning_rate; by "
                                                 "default resuming a checkpoint written with other values is an error "
                                                 "naming the keys (checkpoints keep their config)")
    resume_from_checkpoint: str = OUTPUT("auto", "auto (newest complete, verified checkpoint in output_dir) | none | a "
                                                 "checkpoint path", scope=NODE)
    allow_local_checkpoints: bool = OUTPUT(False, "start even if output_dir is not shared by all nodes; the run then "
                                                  "writes no periodic checkpoint and does not resume")
    checkpoint_dir: str | None = OUTPUT(None, "where checkpoints and final/ go when not output_dir: a shared path, or "
                                              "an object store's URL (s3://bucket/prefix, gs://, az://; pip install "
                                              "'meshtune[s3]', gcs or azure). With a URL, everything a resume needs is "
                                              "in the store and output_dir (metrics, logs, the tokenized cache) may "
                                              "be each node's local disk; credentials and endpoint come from the "
                                              "store's client (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)")
    log_level_all_ranks: Literal["debug", "info", "warning", "error"] | None = OUTPUT(
        None, "every rank logs from this level up, each line tagged [rank N], as HF's log_level_replica (env "
              "MESHTUNE_LOG_LEVEL_ALL_RANKS sets it too). Default: global rank 0 logs (at --log-level), the other "
              "ranks only the warnings they alone can see", scope=NODE)

    @field_validator("save_strategy", "eval_strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> Any:
        """YAML 1.1 reads `no` as false; HF's names are compared without case."""
        if value is False:
            return "no"
        return value.lower() if isinstance(value, str) else value

    @field_validator("resume_from_checkpoint", mode="before")
    @classmethod
    def _resume_not_given(cls, value: Any) -> Any:
        """`resume_from_checkpoint: null` (as LLaMA-Factory's and HF's configs write it) means not given: auto."""
        return "auto" if value is None else value

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value: Any) -> Any:
        """HF's and LLaMA-Factory's values: none, all, a name, a list (or comma-separated names)."""
        names = [] if value is None else value.split(",") if isinstance(value, str) else value
        if not isinstance(names, list):
            return value
        names = list(dict.fromkeys(str(name).strip().lower() for name in names if str(name).strip()))
        if "none" in names and len(names) > 1:
            raise ValueError("none and trackers at once; give none, or the trackers")
        for name in names:
            if name in OTHER_TRACKERS:
                raise ValueError(f"meshtune does not write to {name}; it writes to {', '.join(TRACKERS)} (report_to "
                                 f"names them, or all), and always to output_dir/metrics.jsonl")
            if name not in (*TRACKERS, "all", "none"):
                raise ValueError(f"unknown tracker '{name}'; report_to takes none, all, {', '.join(TRACKERS)} or a "
                                 f"list of them")
        return [] if names == ["none"] else ["all"] if "all" in names else names

    _output_lists = field_validator("resume_allow_changed", mode="before")(staticmethod(split_commas))


class WatchKeys(Keys):
    straggler_threshold: float = WATCH(0.15, "a rank whose own work per step (step time less its waits for the others) "
                                             "exceeds the median rank's by this fraction for straggler_intervals "
                                             "logging intervals in a row is named in a warning with its node and host; "
                                             "metrics.jsonl records the slowest rank of every interval whatever the "
                                             "value. 0: no warning", ge=0)
    straggler_intervals: int = WATCH(3, "logging intervals in a row a rank must stay over straggler_threshold before "
                                        "the warning", gt=0)
    hang_timeout: int | None = WATCH(None, "seconds without a completed optimizer step (evaluations and checkpoint "
                                           "writes not counted) after which every rank writes its stacks and torch's "
                                           "flight recorder of its last collectives to output_dir/hang-<time>/, "
                                           "summary.txt names the ranks that are stuck elsewhere or silent, and the "
                                           "workers exit for torchrun to restart them from the newest checkpoint. "
                                           "Default: 5 x the median step once 5 steps are done, at least 60 s, at most "
                                           "80% of ddp_timeout; until then rank 0 logs every minute that a step is "
                                           "still running, where, and what the GPU allocator holds. 0: off, notices "
                                           "included", ge=0)
