"""Render a conversation with a chat template and mark which tokens are trained.

Labels come from rendering growing prefixes of the conversation and diffing them, so the same code masks
correctly under the written-out LLaMA-Factory formats (data/templates.py) and under any prefix-stable jinja
template a tokenizer ships with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from meshtune.data.templates import FORMATS, template_jinja, with_default_system
from meshtune.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
TEMPLATES = ("chatml", "tokenizer", *(name for name in FORMATS if name != "chatml"))  # and None: the config's auto
TOOL_TEMPLATES = ", ".join(FORMATS)  # every written-out format renders tools

# render_chatml as a jinja chat template, plus LLaMA-Factory's tool format for chatml
CHATML_JINJA = template_jinja("chatml")

# The tokenizer's own template stands in for a named format only if it renders and trains these exactly as the
# format does (the default system prompt, several turns, a tool call and its result); under auto, it is used if it
# renders them prefix-stably.
_PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye."},
    {"role": "assistant", "content": "Goodbye."},
]
_PROBE_TOOLS = [{"name": "probe_lookup", "description": "Look a word up.",
                 "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}]
_PROBE_TOOL_CALL = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Look up probe."},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "probe_lookup", "arguments": {"word": "probe_word"}}]},
    {"role": "tool", "content": "probe_result"},
    {"role": "assistant", "content": "Found."},
]
_SAME_TEXT_PROBES = [(_PROBE, None), (_PROBE[1:], None), (_PROBE_TOOL_CALL, _PROBE_TOOLS),
                     (_PROBE_TOOL_CALL[1:], _PROBE_TOOLS)]


def render_chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """ChatML as Qwen uses it, without a default system prompt."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def serving_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None,
                          default_system: str | None = None) -> str | None:
    """The chat template to save with the trained model when training used a written-out one (or the tokenizer's
    own with another default system prompt); None when the tokenizer's own, as it is, is the one trained."""
    return ChatTemplate(tokenizer, template, default_system=default_system).saved


def _hf_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tool schemas in the form chat templates read: {"type": "function", "function": schema}."""
    return [t if t.get("type") == "function" else {"type": "function", "function": t} for t in tools] if tools else None


def _hf_messages(messages: list[dict]) -> list[dict]:
    """Tool calls in the form chat templates read: {"type": "function", "function": {name, arguments}}."""
    return [
        {**m, "tool_calls": [c if "function" in c else {"type": "function", "function": c} for c in m["tool_calls"]]}
        if m.get("tool_calls") else m
        for m in messages
    ]


@dataclass
class Encoded:
    """A conversation's tokens and labels, and how they split into turns: each assistant turn's prompt (what comes
    before it since the previous turn's response: system, user and tool turns, the assistant header) and response
    (its text or tool calls and end-of-turn), then `suffix` tokens after the last (the eos of the formats without
    an end-of-turn marker). The lengths sum to len(input_ids)."""

    input_ids: list[int]
    labels: list[int]
    turns: list[tuple[int, int]]
    suffix: int = 0


class ChatTemplate:
    """A tokenizer plus the template that turns conversations into (input_ids, labels).

    `template`: None (the config's auto, `TrainConfig.named_template`) uses the tokenizer's own chat template when
    it has one, else ChatML; "tokenizer" requires the tokenizer's own; a format's name (chatml and LLaMA-Factory's
    names) renders as that format: written out as LLaMA-Factory renders it, or through the tokenizer's own
    template only where that renders and trains the probe conversations exactly as the format does.
    `default_system` (LLaMA-Factory's key) is the system prompt of a conversation without one, in place of the
    template's own default.
    `name` is the format ("tokenizer" for the tokenizer's own under None/tokenizer), `own` whether the tokenizer's
    template renders, `description` both in words for the run log, `jinja` the template text in use, `saved` the
    one to save with the model (None: the tokenizer's own, as it is).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None = None, *,
                 train_on_prompt: bool = False, mask_history: bool = False, default_system: str | None = None) -> None:
        if template is not None and template not in TEMPLATES:  # named as the config's key takes them
            raise DataError(f"unknown template '{template}'; use one of auto, {', '.join(TEMPLATES)}")
        self.train_on_prompt, self.mask_history = train_on_prompt, mask_history
        own = getattr(tokenizer, "chat_template", None)
        if template == "tokenizer" and not own:
            raise DataError(
                "template: tokenizer was asked for, but this tokenizer has no chat_template "
                "(tokenizer_config.json / chat_template.jinja); use template: chatml or auto"
            )
        self.tokenizer, self.default_system = tokenizer, default_system
        self.takes_tools = True
        if template in (None, "tokenizer") and own:
            self._use_own("tokenizer", "the tokenizer's own")
            self.takes_tools = self._renders(_PROBE_TOOL_CALL, _PROBE_TOOLS)
            return
        self._write_out(template or "chatml")
        if train_on_prompt and FORMATS[self.name].efficient_eos:
            raise DataError(f"train_on_prompt: true with template: {self.name}: its turns have no end-of-turn text and "
                            f"the eos token that ends an assistant turn is the label of the next prompt's first token, "
                            f"so prompts cannot be trained (LLaMA-Factory refuses it too); drop train_on_prompt")
        if own and self._own_is_the_same():
            self._use_own(self.name, f"{self.name} (the tokenizer's own, which renders it the same)")

    def _write_out(self, name: str) -> None:
        self.name, self.own, self.jinja = name, False, template_jinja(name, self.default_system)
        self.saved = self.jinja
        self.description = f"{name} (written out){self._system_note()}"

    def _system_note(self) -> str:
        return "" if self.default_system is None else f", default system prompt {self.default_system!r}"

    def _own_is_the_same(self) -> bool:
        """Whether the tokenizer's own template encodes every probe conversation as the written-out format does:
        the same tokens, the same ones trained (or both refuse it)."""
        written_out = [self._probe(messages, tools) for messages, tools in _SAME_TEXT_PROBES]
        name = self.name
        self._use_own(name, "")
        own = [self._probe(messages, tools) for messages, tools in _SAME_TEXT_PROBES]
        same = any(written_out) and own == written_out
        if not same:
            self._write_out(name)
        return same

    def _probe(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]] | None:
        try:
            return self._encode(messages, tools)
        except DataError:
            return None

    def _use_own(self, name: str, description: str) -> None:
        self.name, self.description, self.own = name, description + self._system_note(), True
        self.jinja = self.tokenizer.chat_template
        if self.default_system is not None:
            self.jinja = with_default_system(self.jinja, self.default_system)
        self.saved = None if self.default_system is None else self.jinja

    def _renders(self, messages: list[dict], tools: list[dict] | None = None) -> bool:
        """Whether the template in use masks `messages` and shows their tools, calls and results."""
        try:
            self._encode(messages, tools)
        except DataError:
            return False
        text = self._render(_hf_messages(messages), False, _hf_tools(tools))
        return not tools or all(word in text for word in ("probe_lookup", "probe_word", "probe_result"))

    def _render(self, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> str:
        if not messages:  # transformers refuses an empty conversation; it renders to nothing here
            if not add_generation_prompt:
                return ""
            if self.own:  # a default system prompt would be trained as the header
                raise DataError(
                    "a conversation starts with an assistant message, which cannot be masked under the "
                    "tokenizer's chat template; start it with a user message or use template: chatml"
                )
            # the header of a leading assistant message: written out, an empty system message renders as none,
            # so this is the prefix, the default system prompt and the header
            messages = [{"role": "system", "content": ""}]
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.saved, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except (TemplateError, ValueError, TypeError) as e:
            fix = "fix the record, or use template: chatml" if self.own else "fix the record"
            raise DataError(f"the chat template ({self.description}) failed on a conversation ({e}); {fix}") from None

    def _check_tools(self, messages: list[dict], tools: list[dict] | None) -> None:
        if not self.takes_tools and (tools or any(m.get("tool_calls") for m in messages)):
            raise DataError(
                f"a conversation has tools, but the chat template ({self.description}) has no tool format (it does "
                f"not render tools and tool calls prefix-stably); use one of the templates that take tools: "
                f"{TOOL_TEMPLATES}"
            )

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The text to generate from: the conversation followed by the assistant generation prompt."""
        self._check_tools(messages, tools)
        return self._render(_hf_messages(messages), True, _hf_tools(tools))

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """Token ids and labels (unshifted) of a conversation; `tools`: the function schemas it may call.

        Trained: each assistant message's content or tool calls, its end-of-turn marker and whatever the template
        puts right after it. Not trained: system, user and tool turns and the assistant header (the generation
        prompt), unless `train_on_prompt`; with `mask_history` only the last assistant message trains. Formats
        without an end-of-turn marker (glm4, baichuan2) train the eos token in its place, as LLaMA-Factory does: as
        the label of the next turn's first token, and appended after the last turn.
        """
        encoded = self.encode_turns(messages, tools)
        return encoded.input_ids, encoded.labels

    def encode_turns(self, messages: list[dict], tools: list[dict] | None = None) -> Encoded:
        """`encode`, with the lengths of its turns: what cutoff_len truncates turn by turn (data/truncation.py)."""
        self._check_tools(messages, tools)
        return self._encode(messages, tools)

    def _encode(self, messages: list[dict], tools: list[dict] | None) -> Encoded:
        messages, tools = _hf_messages(messages), _hf_tools(tools)
        pieces: list[tuple[str, bool, bool]] = []  # (text, trained, an assistant message's own text)
        before = ""
        last_answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                header = self._render(messages[:i], True, tools)
                pieces.append((self._added(before, header), self.train_on_prompt, False))
                before = header
            after = self._render(messages[: i + 1], False, tools)
            answer = message["role"] == "assistant" and (not self.mask_history or i == last_answer)
            pieces.append((self._added(before, after), answer or (message["role"] != "assistant" and
                                                                  self.train_on_prompt),
                           message["role"] == "assistant"))
            before = after
        input_ids: list[int] = []
        labels: list[int] = []
        turns: list[tuple[int, int]] = []  # (prompt tokens, response tokens) of each assistant turn
        prompt = 0
        eos = self.tokenizer.eos_token_id if not self.own and FORMATS[self.name].efficient_eos else None
        after_trained = False
        for text, trained, response in pieces:
            if not text:
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False, verbose=False)  # cutoff_len truncates later
            input_ids += ids
            untrained = [IGNORE_INDEX] * len(ids)
            if eos is not None and after_trained and not trained:  # the turn ends with eos, predicted here
                untrained[0] = eos
            labels += ids if trained else untrained
            after_trained = trained
            if response:
                turns.append((prompt, len(ids)))
                prompt = 0
            else:
                prompt += len(ids)
        if prompt:  # text after the last assistant turn: a prompt with no response
            turns.append((prompt, 0))
        suffix = 0
        if eos is not None and after_trained:
            input_ids.append(eos)
            labels.append(eos)
            suffix = 1
        return Encoded(input_ids, labels, turns, suffix)

    def _added(self, before: str, after: str) -> str:
        """What rendering one more step appended; labels are only sound if earlier text never changes."""
        if not after.startswith(before):
            raise DataError(
                f"the chat template ({self.description}) does not render conversations prefix-stably: rendering "
                "one more message changed earlier text, so trained tokens cannot be told apart; use template: chatml"
            )
        return after[len(before):]
