"""Render a conversation with a chat template and mark which tokens are trained.

Labels come from rendering growing prefixes of the conversation and diffing them, so the same code masks
correctly under the built-in ChatML and under any prefix-stable jinja template a tokenizer ships with;
no per-model-family template table to maintain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from jinja2 import TemplateError

from meshtune.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
TEMPLATES = ("auto", "chatml", "tokenizer")


def render_chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """ChatML as Qwen uses it, without a default system prompt."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


# render_chatml as a jinja chat template, saved with the trained model so that serving renders prompts as trained
CHATML_JINJA = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")


def serving_chat_template(tokenizer: PreTrainedTokenizerBase, template: str) -> str | None:
    """The chat template to save with the trained model when training used one the tokenizer does not carry
    (the built-in ChatML); None when the tokenizer's own is the one trained."""
    return CHATML_JINJA if ChatTemplate(tokenizer, template).name == "chatml" else None


class ChatTemplate:
    """A tokenizer plus the template that turns conversations into (input_ids, labels).

    `template`: "auto" uses the tokenizer's own chat template when it has one, else ChatML; "chatml" always
    uses the built-in ChatML; "tokenizer" requires the tokenizer's own. `name` tells which one is in use.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str = "auto") -> None:
        if template not in TEMPLATES:
            raise DataError(f"unknown template '{template}'; use one of {', '.join(TEMPLATES)}")
        has_own = bool(getattr(tokenizer, "chat_template", None))
        if template == "tokenizer" and not has_own:
            raise DataError(
                "template: tokenizer was asked for, but this tokenizer has no chat_template "
                "(tokenizer_config.json / chat_template.jinja); use template: chatml or auto"
            )
        self.tokenizer = tokenizer
        self.name = "chatml" if template == "chatml" or not has_own else "tokenizer"
        self._render: Callable[[list[dict], bool], str] = (
            self._render_tokenizer if self.name == "tokenizer" else render_chatml
        )

    def _render_tokenizer(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if not messages:  # transformers refuses an empty conversation; it renders to nothing here
            if add_generation_prompt:  # a template's default system prompt would be trained as the header
                raise DataError(
                    "a conversation starts with an assistant message, which cannot be masked under the "
                    "tokenizer's chat template; start it with a user message or use template: chatml"
                )
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, ValueError, TypeError) as e:
            raise DataError(
                f"the tokenizer's chat template failed on a conversation ({e}); "
                "fix the record, or use template: chatml"
            ) from None

    def render_prompt(self, messages: list[dict]) -> str:
        """The text to generate from: the conversation followed by the assistant generation prompt."""
        return self._render(messages, True)

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Token ids and labels (unshifted) of a conversation.

        Trained: each assistant message's content, its end-of-turn marker and whatever the template puts right
        after it. Not trained: system, user and tool turns and the assistant header (the generation prompt).
        """
        pieces: list[tuple[str, bool]] = []  # (text, trained)
        before = self._render(messages[:0], False)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                header = self._render(messages[:i], True)
                pieces.append((self._added(before, header), False))
                before = header
            after = self._render(messages[: i + 1], False)
            pieces.append((self._added(before, after), message["role"] == "assistant"))
            before = after
        input_ids: list[int] = []
        labels: list[int] = []
        for text, trained in pieces:
            if not text:
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False, verbose=False)  # cutoff_len truncates later
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
        return input_ids, labels

    def _added(self, before: str, after: str) -> str:
        """What rendering one more step appended; labels are only sound if earlier text never changes."""
        if not after.startswith(before):
            raise DataError(
                f"the chat template ({self.name}) does not render conversations prefix-stably: rendering one "
                "more message changed earlier text, so trained tokens cannot be told apart; use template: chatml"
            )
        return after[len(before):]
