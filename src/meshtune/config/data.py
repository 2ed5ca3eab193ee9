"""The data: the datasets and their format, the chat template, what trains, lengths and packing."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from meshtune.config.autos import template_choice
from meshtune.config.chat_formats import TEMPLATE_NAMES
from meshtune.config.section import MATH, NODE, Keys, Section, split_commas

DATA = Section("data", MATH)
TEXT_FORMAT = "text"  # how stage: pt reads its datasets (data/raw_text.py)
UNPAIRED_FORMAT = "unpaired"  # how stage: kto reads its datasets (data/unpaired.py)


class DataKeys(Keys):
    dataset: list[str] = DATA(description="training data: file(s), JSON list or JSONL, or names in "
                                          "dataset_dir/dataset_info.json (LLaMA-Factory's registry); comma-separated "
                                          "or a list")
    eval_dataset: list[str] | None = DATA(None, "held-out data file(s) or dataset_info.json names; otherwise val_size "
                                                "splits the training data")
    dataset_dir: str = DATA("data", "folder of LLaMA-Factory's dataset_info.json: a dataset entry that is no file is "
                                    "looked up there by name (its file_name, formatting, columns and tags)")
    max_samples: int | None = DATA(None, "use only the first N records of each dataset (as LLaMA-Factory); "
                                         "default: all", gt=0)
    dataset_format: Literal["auto", "alpaca", "sharegpt", "qwen", "messages"] = DATA(
        "auto", "auto (detected per file) | alpaca | sharegpt | qwen | messages")
    template: Literal[("auto", "tokenizer", *TEMPLATE_NAMES)] = DATA(
        "auto", "auto (the tokenizer's chat template, else ChatML) | tokenizer (its own, required) | chatml | "
                f"LLaMA-Factory's names: {', '.join(TEMPLATE_NAMES[1:])} (rendered as LLaMA-Factory renders them: the "
                "tokenizer's own template only where it renders the same text; final/ saves the one trained)")
    default_system: str | None = DATA(None, "the system prompt of a conversation that has none (LLaMA-Factory's key): "
                                            "replaces the template's own default; Qwen's finetune.py flags set "
                                            "'You are a helpful assistant.', as finetune.py renders")
    train_on_prompt: bool = DATA(False, "also train on the prompt: system, user and tool turns and the assistant "
                                        "header (LLaMA-Factory's key); default: assistant turns only")
    mask_history: bool = DATA(False, "train only the last assistant turn of each conversation, earlier ones are "
                                     "context; a conversation longer than cutoff_len gives its last turn the tokens "
                                     "first (LLaMA-Factory's key)")
    cutoff_len: int = DATA(2048, "the most tokens a sample keeps. A longer one is cut as LLaMA-Factory cuts it: turn "
                                 "by turn while tokens remain, each turn's prompt and response shortened to share "
                                 "what is left (each keeps its first tokens), so a long prompt is cut and its "
                                 "response still trained", gt=1)
    val_size: float = DATA(0.0, "held-out part of the training data: a fraction (<1) or a count", ge=0.0)
    skip_invalid: bool = DATA(False, "skip malformed records (counted) instead of stopping at the first")
    tokenized_path: str | None = DATA(None, "where the tokenized cache lives (default: output_dir/tokenized); put it "
                                            "on storage all nodes share to tokenize once", scope=NODE)
    packing: bool = DATA(False, "pack samples into rows of up to cutoff_len (no attention across samples): fewer, "
                                "fuller rows; default true for stage: pt")
    group_by_length: bool = DATA(False, "without packing: micro-batches of similar lengths inside each global batch "
                                        "(less padding)")
    dataloader_drop_last: bool = DATA(False, "drop each epoch's last partial global batch: every step then trains "
                                             "exactly the global batch, and the rows left over are not trained that "
                                             "epoch. Default: as HF Trainer, an epoch's last step trains the rows left "
                                             "over, so every sample is seen each epoch")

    _data_lists = field_validator("dataset", "eval_dataset", mode="before")(staticmethod(split_commas))

    @model_validator(mode="after")
    def _check_data(self) -> "DataKeys":
        if not self.dataset:
            raise ValueError("dataset: no file given; set dataset: path/to/train.jsonl")
        if self.val_size >= 1 and self.val_size != int(self.val_size):
            raise ValueError(f"val_size: {self.val_size} is neither a fraction below 1 nor a whole count")
        return self

    @property
    def named_template(self) -> str | None:
        """template, or None (auto): the tokenizer's own chat template where it has one, else ChatML."""
        return template_choice(self.template)
