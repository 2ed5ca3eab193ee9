"""`meshtune chat`: talk to a trained model, prompts on stdin and answers streamed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshtune.cli.export import from_store


CHAT_HELP = """\
Talk to a trained model: each line on stdin is your turn, the answer is streamed as it is generated, and the
conversation keeps its history. DIR is what meshtune wrote: a run's output_dir (its final/, else its newest
complete checkpoint, exported into a temporary folder first), final/ itself (a PEFT adapter or a full model), a
checkpoint-N, or an export (`meshtune export`, adapter or merged); or a base model with --adapter PATH.
Prompts are rendered with the chat template saved with the model, as training rendered them (--template NAME for a
model saved without one). On a terminal: /reset starts a new conversation, /exit or Ctrl-D ends it, Ctrl-C stops an
answer. From a pipe, every line is a turn and every answer one line of stdout:
  printf 'Hi!\\nAnd then?\\n' | meshtune chat output_dir
"""


def add_to(commands, debug: argparse.ArgumentParser, job: argparse.ArgumentParser) -> None:
    """`meshtune chat` and its options on meshtune's parser."""
    chat = commands.add_parser("chat", help="talk to a trained model: prompts on stdin, answers streamed",
                               parents=[debug], description=CHAT_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("dir", help="output_dir, its final/, a checkpoint-N, an export, or a base model (with --adapter)")
    chat.add_argument("--adapter", metavar="PATH", type=Path,
                      help="a PEFT adapter (a LoRA run's final/ or output_dir, an export) on the base model DIR")
    chat.add_argument("--base", metavar="DIR", type=Path,
                      help="the base model under the adapter DIR (default: the one it names, where it was trained)")
    chat.add_argument("--template", metavar="NAME",
                      help="render prompts with this chat template instead of the one saved with the model "
                           "(chatml, qwen, llama3, ...: the names of the config key `template`)")
    chat.add_argument("--system", metavar="TEXT", help="a system prompt that starts the conversation")
    chat.add_argument("--max-new-tokens", type=int, default=512, metavar="N", help="longest answer (default 512)")
    chat.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="0 (default): greedy, the same answers every time; above 0: sampled")
    chat.add_argument("--top-p", type=float, default=1.0, metavar="P",
                      help="nucleus sampling when sampled (default 1.0: off)")
    chat.add_argument("--device", default="auto", help="auto (default: cuda when there is a GPU, else cpu), cpu, "
                                                       "cuda or cuda:N")
    chat.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                      help="weights' dtype (default auto: bf16 on a GPU that has it, else fp32)")
    chat.add_argument("--show-prompt", action="store_true",
                      help="print each prompt as the model receives it, rendered (to stderr)")


def run(args: argparse.Namespace) -> int:
    from meshtune.export.chat import ChatOptions, run_chat, terminal_lines

    options = ChatOptions(adapter=args.adapter, base=args.base, template=args.template, system=args.system,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          device=args.device, dtype=args.dtype, show_prompt=args.show_prompt)
    interactive = sys.stdin.isatty()
    with from_store(args.dir) as source:
        return run_chat(source, options, terminal_lines() if interactive else sys.stdin, interactive)
