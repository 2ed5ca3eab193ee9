"""`meshtune preview`: the samples, trained tokens and lengths training will see, without training."""

from __future__ import annotations

import argparse
import sys

from meshtune.cli.job import load_training_config
from meshtune.errors import MeshtuneError


PREVIEW_HELP = """\
Show what `meshtune train` with the same config and overrides trains on, without training: no process group, no
GPU, no model weights (the tokenizer only). The data takes training's own path: read, rendered with the chat
template, tokenized and cut to cutoff_len into the tokenized cache (output_dir/tokenized or tokenized_path; built
here when no run has built it yet, and then reused by train), and the samples shown are that cache's rows.

It prints:
  - the template and which turns it trains; the settings that shape the samples
  - each dataset: its files, the format their records were read in, their record counts; records -> samples,
    tokens and trained tokens; min / median / p95 / max of the tokens per sample as trained, before cutoff_len, and
    of the trained tokens per sample (median and p95 interpolated as numpy.percentile does); the samples cutoff_len
    truncates (longer than cutoff_len: cut as LLaMA-Factory cuts, turn by turn, each turn's prompt and response
    shortened to share what is left; the last turn first with mask_history) and drops (no trained token left in
    what is kept), the records skip_invalid skipped, the samples val_size holds out
  - N samples (-n; --index or --seed choose which), decoded from the cache's token ids with the template's
    special tokens written out (<|im_start|>, <|im_end|>, ...):
      ⟦text⟧   trained: the loss has these tokens as targets (their label in the cache is the token itself)
      ⟦→x⟧     a target that is not the input token at that place: the loss trains x there, and the token
               written after the mark is input only (templates without end-of-turn text, glm4 and baichuan2,
               train eos so where the next turn begins)
      the rest is context only (label -100). A sample's first token is never a target: nothing comes before it.
    On a terminal the trained text is green too (--color).
Samples are numbered by their position in the tokenized training data, from 0, as a non-finite step's error names
them; each header names the file and record the sample came from.
--json prints the same as one JSON document: each sample also with its input_ids, the cache's labels and a 0/1
"trained" list.
"""


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune preview` and its options on meshtune's parser."""
    preview = commands.add_parser("preview", help="show the samples, trained tokens and lengths training will see",
                                  parents=[job, debug], description=PREVIEW_HELP,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    preview.add_argument("-n", "--samples", type=int, default=3, metavar="N",
                         help="samples to show (default 3): the first N, or N drawn with --seed")
    preview.add_argument("--index", type=positions, metavar="I[,J...]",
                         help="the samples at these positions in the tokenized training data (from 0)")
    preview.add_argument("--seed", type=int, help="draw the samples at random with this seed (the same each time)")
    preview.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                         help="green trained text: auto (default) on a terminal only, always, never")
    preview.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def positions(text: str) -> list[int]:
    """`--index 3,17`: sample positions."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give positions as numbers separated by commas, e.g. 3,17")


def run(args: argparse.Namespace) -> int:
    import json

    from meshtune.data.preview import preview, render_text, use_color
    from meshtune.model.model_dir import check_model_dir, load_tokenizer

    if args.index is not None and args.seed is not None:
        raise MeshtuneError("--index and --seed both choose the samples shown; give one of them")
    cfg, _ = load_training_config(args)  # the errors train gives, before any data is read
    tokenizer = load_tokenizer(check_model_dir(cfg.model_name_or_path))
    report = preview(cfg, tokenizer, samples=args.samples, indices=args.index, seed=args.seed,
                     show_progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        print(render_text(report, color=use_color(args.color, sys.stdout)))
    return 0
