"""Label masking: only assistant content and its end-of-turn marker are trained, under ChatML and jinja templates."""

from __future__ import annotations

import copy

import pytest

from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate, render_chatml, serving_chat_template
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.errors import DataError

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant.",
    "What is the capital of France? Paris is the capital of France.",
    "Tell me a joke about numbers: seven ate nine.",
    "Sure, here is a short answer to your question.",
    "The weather today is sunny with a light breeze.",
] * 6

# Qwen2.5's template, shortened: a default system prompt when the conversation has none.
QWEN25_TEMPLATE = (
    r"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    r"{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Puts the number of messages first, so adding a message rewrites earlier text.
UNSTABLE_TEMPLATE = (
    r"{{- messages|length }}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    r"{%- endfor %}"
)

SINGLE = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]
MULTI = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Seven ate nine."},
    {"role": "user", "content": "Another one?"},
    {"role": "tool", "content": "{\"joke\": 2}"},
    {"role": "assistant", "content": "The quick brown fox."},
]


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(SENTENCES)


def with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def trained_spans(tokenizer, input_ids: list[int], labels: list[int]) -> list[str]:
    """Decode each run of consecutive labelled tokens."""
    spans, run = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            spans.append(run)
            run = []
    if run:
        spans.append(run)
    return [tokenizer.decode(s, skip_special_tokens=False) for s in spans]


def expected_spans(messages):
    return [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi-turn-system-tool"])
def test_chatml_labels_only_assistant(tokenizer, messages):
    template = ChatTemplate(tokenizer)
    assert template.name == "chatml"
    input_ids, labels = template.encode(messages)
    assert len(input_ids) == len(labels)
    assert tokenizer.decode(input_ids, skip_special_tokens=False) == render_chatml(messages)
    assert trained_spans(tokenizer, input_ids, labels) == expected_spans(messages)


def test_assistant_header_is_not_trained(tokenizer):
    input_ids, labels = ChatTemplate(tokenizer, "chatml").encode(SINGLE)
    untrained = tokenizer.decode([t for t, lab in zip(input_ids, labels) if lab == IGNORE_INDEX])
    assert untrained.endswith("<|im_start|>assistant\n")


def test_qwen25_style_jinja_template(tokenizer):
    tok = with_template(tokenizer, QWEN25_TEMPLATE)
    template = ChatTemplate(tok)  # auto picks the tokenizer's own
    assert template.name == "tokenizer"
    for messages in (SINGLE, MULTI):
        input_ids, labels = template.encode(messages)
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert tok.decode(input_ids, skip_special_tokens=False) == rendered
        assert trained_spans(tok, input_ids, labels) == expected_spans(messages)
    assert tok.decode(template.encode(SINGLE)[0]).startswith("<|im_start|>system\nYou are Qwen")


def test_chatml_forced_over_tokenizer_template(tokenizer):
    template = ChatTemplate(with_template(tokenizer, QWEN25_TEMPLATE), "chatml")
    assert template.name == "chatml"
    assert template.render_prompt(SINGLE) == render_chatml(SINGLE) + "<|im_start|>assistant\n"


def test_render_prompt(tokenizer):
    prompt = ChatTemplate(with_template(tokenizer, QWEN25_TEMPLATE)).render_prompt(SINGLE[:1])
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_not_prefix_stable_template_raises(tokenizer):
    template = ChatTemplate(with_template(tokenizer, UNSTABLE_TEMPLATE))
    with pytest.raises(DataError, match="prefix-stably.*template: chatml"):
        template.encode(SINGLE)


def test_template_tokenizer_without_one_raises(tokenizer):
    with pytest.raises(DataError, match="no chat_template"):
        ChatTemplate(tokenizer, "tokenizer")


def test_unknown_template_name(tokenizer):
    with pytest.raises(DataError, match="'vicuna'; use one of auto, chatml, tokenizer, qwen"):
        ChatTemplate(tokenizer, "vicuna")


def test_leading_assistant_under_tokenizer_template(tokenizer):
    messages = SINGLE[::-1]
    with pytest.raises(DataError, match="starts with an assistant message"):
        ChatTemplate(with_template(tokenizer, QWEN25_TEMPLATE)).encode(messages)
    input_ids, labels = ChatTemplate(tokenizer).encode(messages)
    assert trained_spans(tokenizer, input_ids, labels) == ["Paris.<|im_end|>\n"]


def test_template_error_becomes_data_error(tokenizer):
    tok = with_template(tokenizer, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match="roles must alternate.*template: chatml"):
        ChatTemplate(tok).encode(SINGLE)


def test_the_chat_template_saved_for_serving_renders_as_training_did(tokenizer):
    """Trained with the built-in ChatML (the tokenizer has none, or chatml was forced): the jinja template saved
    with the model renders every conversation, and the generation prompt, exactly as training did."""
    for tok, template in ((tokenizer, None), (with_template(tokenizer, QWEN25_TEMPLATE), "chatml")):  # None: auto
        saved = serving_chat_template(tok, template)
        served = with_template(tok, saved)
        for messages in (SINGLE, MULTI):
            assert served.apply_chat_template(messages, tokenize=False) == render_chatml(messages)
            assert served.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True) == \
                ChatTemplate(tok, template).render_prompt(messages[:-1])
    assert serving_chat_template(with_template(tokenizer, QWEN25_TEMPLATE), None) is None  # its own is saved


def test_train_on_prompt_trains_every_token(tokenizer):
    """LLaMA-Factory's train_on_prompt: system, user and tool turns and the assistant headers are trained too."""
    input_ids, labels = ChatTemplate(tokenizer, "chatml", train_on_prompt=True).encode(MULTI)
    assert labels == input_ids
    assert ChatTemplate(tokenizer, "chatml").encode(MULTI)[0] == input_ids  # the same text, other labels


def test_mask_history_trains_only_the_last_assistant_turn(tokenizer):
    input_ids, labels = ChatTemplate(tokenizer, "chatml", mask_history=True).encode(MULTI)
    assert trained_spans(tokenizer, input_ids, labels) == expected_spans(MULTI)[-1:]
    both = ChatTemplate(tokenizer, "chatml", mask_history=True, train_on_prompt=True).encode(MULTI)[1]
    first_answer = render_chatml(MULTI[:2]) + "<|im_start|>assistant\n"  # trained as prompt, then the masked answer
    assert both[:len(tokenizer.encode(first_answer))] == tokenizer.encode(first_answer)
    assert IGNORE_INDEX in both and both[-1] != IGNORE_INDEX


def test_train_on_prompt_is_refused_where_eos_ends_each_turn(tokenizer):
    with pytest.raises(DataError, match="train_on_prompt: true with template: glm4"):
        ChatTemplate(tokenizer, "glm4", train_on_prompt=True)
