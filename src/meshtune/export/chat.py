"""`meshtune chat DIR`: one conversation with a trained model, prompts read on stdin, answers streamed to stdout.

Prompts are rendered with the chat template saved beside the model (the one training rendered with), so the model
sees its turns as it was trained on them. Decoding is greedy unless a temperature is given, so the same prompts
give the same answers. On a terminal it is an interactive chat; from a pipe, each line is a turn and each answer
one line of output, for scripts.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtune.data.chat_template import IGNORE_INDEX, TEMPLATES, ChatTemplate
from meshtune.errors import ConfigError, ModelError
from meshtune.export.chat_source import ChatModel, locate
from meshtune.model.loading import load_model
from meshtune.model.model_dir import load_tokenizer

RESET, EXIT = "/reset", ("/exit", "/quit")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ChatOptions:
    """What `meshtune chat` takes besides DIR; `template` None: the one saved with the model."""

    adapter: Path | None = None
    base: Path | None = None
    template: str | None = None
    system: str | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    device: str = "auto"
    dtype: str = "auto"
    show_prompt: bool = False


def check_options(options: ChatOptions) -> None:
    if options.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {options.max_new_tokens}: an answer needs at least 1 token")
    if options.temperature < 0:
        raise ConfigError(f"--temperature {options.temperature}: 0 decodes greedily, above 0 samples; not below 0")
    if not 0 < options.top_p <= 1:
        raise ConfigError(f"--top-p {options.top_p}: the share of probability sampled from, above 0 and at most 1")


def pick_device(name: str) -> torch.device:
    """`auto`: the GPU where there is one, else the CPU (a command-line option, not a config key)."""
    name = {"auto": "cuda" if torch.cuda.is_available() else "cpu"}.get(name, name)
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA GPU here; use --device cpu")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on a GPU that computes in it, fp32 elsewhere (bf16 and fp16 are slow or unsupported on CPUs)."""
    if name in DTYPES:
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


def chat_template(tokenizer, template: str | None, where: Path) -> ChatTemplate:
    """The template saved with the model, or the format `template` names (as training picks it)."""
    if template is not None:
        if template not in TEMPLATES:
            raise ConfigError(f"--template {template}: not a chat template meshtune knows; use one of "
                              f"{', '.join(TEMPLATES)}")
        return ChatTemplate(tokenizer, template)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"the tokenizer in {where} has no chat template (no chat_template.jinja, no chat_template in "
            f"tokenizer_config.json) to render prompts with; pass --template NAME, one of meshtune's templates "
            f"({', '.join(name for name in TEMPLATES if name != 'tokenizer')}). A run's final/ and its exports carry "
            f"the template it trained with")
    return ChatTemplate(tokenizer, "tokenizer")


def stop_ids(template: ChatTemplate, tokenizer, model) -> list[int]:
    """The tokens that end an answer: the eos tokens, and the special token that ends an assistant turn under the
    template (ChatML's <|im_end|>, Llama 3's <|eot_id|>), found among the tokens training labels after an answer."""
    ids, labels = template.encode([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}])
    special = set(tokenizer.all_special_ids) | {i for i, token in tokenizer.added_tokens_decoder.items()
                                                if token.special}
    ending = next((i for i, label in zip(ids, labels) if label != IGNORE_INDEX and i in special), None)
    saved = model.generation_config.eos_token_id
    found = [tokenizer.eos_token_id, ending, *(saved if isinstance(saved, list) else [saved])]
    return list(dict.fromkeys(i for i in found if i is not None))


class Conversation:
    """The turns so far, the system prompt first; `/reset` keeps the system prompt."""

    def __init__(self, template: ChatTemplate, system: str | None) -> None:
        self.template = template
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.start)

    def reset(self) -> None:
        self.messages = list(self.start)

    def prompt(self, user: str) -> str:
        """The text the model continues: every turn so far, `user`'s, and the assistant's header."""
        self.messages.append({"role": "user", "content": user})
        return self.template.render_prompt(self.messages)

    def answered(self, answer: str) -> None:
        self.messages.append({"role": "assistant", "content": answer})

    def withdraw(self) -> None:
        """The last user turn taken back (its answer was interrupted)."""
        self.messages.pop()


class Responder:
    """The model answering one prompt at a time, each answer streamed to stdout as it is generated."""

    def __init__(self, model, tokenizer, template: ChatTemplate, options: ChatOptions) -> None:
        from transformers import GenerationConfig, TextStreamer

        self.model, self.tokenizer = model, tokenizer
        sample = options.temperature > 0
        # only these settings decide the answer, not the sampling defaults of the model's generation_config.json;
        # set on the transformers model, whose generate() a peft model calls
        unwrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
        unwrapped.generation_config = GenerationConfig(
            max_new_tokens=options.max_new_tokens, do_sample=sample,
            temperature=options.temperature if sample else None, top_p=options.top_p if sample else None,
            top_k=0 if sample else None, eos_token_id=stop_ids(template, tokenizer, model),
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
        self.streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    @torch.inference_mode()
    def answer(self, prompt: str) -> str:
        # the template writes every special token itself, as training tokenized it
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(self.model.device)
        output = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=self.streamer)
        return self.tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).strip()


def load(found: ChatModel, options: ChatOptions, device: torch.device, dtype: torch.dtype):
    """The model (with its adapter) on `device`, its tokenizer and the chat template."""
    tokenizer = load_tokenizer(found.tokenizer)
    template = chat_template(tokenizer, options.template, found.tokenizer)
    model = load_model(found.model, dtype)
    if found.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(found.adapter))
    return model.to(device).eval(), tokenizer, template


def run_chat(path: Path, options: ChatOptions, lines: Iterable[str], interactive: bool) -> int:
    """Load what `path` holds, then one turn per line of `lines` until /exit or their end. `interactive`: a person
    at a terminal (a greeting, prompts, an interrupted answer dropped); else only the answers are printed."""
    say: Callable[[str], None] = print if interactive else (lambda line: print(line, file=sys.stderr))
    check_options(options)
    device = pick_device(options.device)
    dtype = pick_dtype(options.dtype, device)
    with tempfile.TemporaryDirectory(prefix="meshtune-chat-") as workdir:  # a checkpoint's export, once loaded
        found = locate(path, Path(workdir), options.adapter, options.base, note=say)
        model, tokenizer, template = load(found, options, device, dtype)
    conversation = Conversation(template, options.system)
    responder = Responder(model, tokenizer, template, options)
    if interactive:
        rendering = template.description if options.template else "the one saved with it"
        print(f"meshtune chat: {found.description}, on {device} in {str(dtype).removeprefix('torch.')}, chat "
              f"template: {rendering}\n{RESET} starts a new conversation, {EXIT[0]} or Ctrl-D ends it")
    for line in lines:
        text = line.strip()
        if text in EXIT:
            break
        if text == RESET:
            conversation.reset()
            if interactive:
                print("(a new conversation)")
            continue
        if not text:
            continue
        prompt = conversation.prompt(text)
        if options.show_prompt:
            print(f"--- prompt ---\n{prompt}\n--- end of prompt ---", file=sys.stderr, flush=True)
        if interactive:
            print("Assistant: ", end="", flush=True)
        try:
            conversation.answered(responder.answer(prompt))
        except KeyboardInterrupt:
            if not interactive:
                raise
            conversation.withdraw()
            print("\n(answer stopped; it is not part of the conversation)")
    return 0


def terminal_lines(prompt: str = "User: ") -> Iterable[str]:
    """Lines a person types (with line editing), until Ctrl-D or Ctrl-C."""
    import readline  # noqa: F401  (input() edits lines and keeps a history once it is loaded)

    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            print()
            return
