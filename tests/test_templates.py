"""LLaMA-Factory template names: the exact text each renders, what is trained, tool calls, when the tokenizer's own
template stands in for one (only where it renders the same), and the template saved for serving."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from meshtune.data.chat_template import IGNORE_INDEX, ChatTemplate, serving_chat_template
from meshtune.config import TEMPLATE_NAMES
from meshtune.data.templates import FORMATS
from meshtune.demo.tokenizer import train_tokenizer
from meshtune.errors import DataError
from test_chat_template import trained_spans, with_template

FIXTURES = Path(__file__).parent / "fixtures" / "templates"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Be brief.",
    "What is the weather in Paris? It is 20 degrees.",
] * 6

SYSTEM = [{"role": "system", "content": "Be brief."}]
CHAT = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]

QWEN_DEFAULT = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
ALPACA_DEFAULT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                  "request.\n\n")
CHATML = "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
CHATML_SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"
THINK_CHATML = "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n"
LLAMA3_USER = ("<|start_header_id|>user<|end_header_id|>\n\nHi.<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>")

GEMMA_USER = "<start_of_turn>user\n{}<end_of_turn>\n"
GEMMA_MODEL = "<start_of_turn>model\nHello.<end_of_turn>\n"
PHI = "<|user|>\nHi.<|end|>\n<|assistant|>\nHello.<|end|>\n"
PHI4 = "<|im_start|>user<|im_sep|>Hi.<|im_end|><|im_start|>assistant<|im_sep|>Hello.<|im_end|>"
INTERN_DEFAULT = ("You are an AI assistant whose name is InternLM (书生·浦语).\n"
                  "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI "
                  "Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
                  "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the user "
                  "such as English and 中文.")
COHERE = ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
          "Hello.</s>")

# name: (the template's text with the system message, without one, trained text of the assistant turn); formats
# without an end-of-turn text (efficient_eos) append the eos token to the training sample

EXPECTED = {
    "chatml": (CHATML_SYSTEM + CHATML, CHATML, "Hello.<|im_end|>\n"),
    "qwen": (CHATML_SYSTEM + CHATML, QWEN_DEFAULT + CHATML, "Hello.<|im_end|>\n"),
    "qwen3": (CHATML_SYSTEM + THINK_CHATML, THINK_CHATML, "<think>\n\n</think>\n\nHello.<|im_end|>\n"),
    "qwen3_nothink": (CHATML_SYSTEM + CHATML, CHATML, "Hello.<|im_end|>\n"),
    "llama3": ("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" + LLAMA3_USER,
               "<s>" + LLAMA3_USER, "Hello.<|eot_id|>"),
    "llama2": ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi. [/INST]Hello.</s>", "<s>[INST] Hi. [/INST]Hello.</s>",
               "Hello.</s>"),
    "mistral": ("<s>[INST] Be brief.\n\nHi.[/INST] Hello.</s>", "<s>[INST] Hi.[/INST] Hello.</s>", " Hello.</s>"),
    "default": ("System: Be brief.</s>\nHuman: Hi.</s>\nAssistant:Hello.</s>\n",
                "Human: Hi.</s>\nAssistant:Hello.</s>\n", "Hello.</s>\n"),
    "empty": ("Be brief.Hi.Hello.", "Hi.Hello.", "Hello."),
    "alpaca": ("Be brief.### Instruction:\nHi.\n\n### Response:\nHello.</s>\n\n",
               ALPACA_DEFAULT + "### Instruction:\nHi.\n\n### Response:\nHello.</s>\n\n", "Hello.</s>\n\n"),
    "gemma": ("<s>" + GEMMA_USER.format("Be brief.\n\nHi.") + GEMMA_MODEL,
              "<s>" + GEMMA_USER.format("Hi.") + GEMMA_MODEL, "Hello.<end_of_turn>\n"),
    "gemma3": ("<s>" + GEMMA_USER.format("Be brief.\n\nHi.") + GEMMA_MODEL,
               "<s>" + GEMMA_USER.format("Hi.") + GEMMA_MODEL, "Hello.<end_of_turn>\n"),
    "phi": ("<|system|>\nBe brief.<|end|>\n" + PHI, PHI, "Hello.<|end|>\n"),
    "phi4": ("<|im_start|>system<|im_sep|>Be brief.<|im_end|>" + PHI4, PHI4, "Hello.<|im_end|>"),
    "deepseek": ("<s>Be brief.\n\nUser: Hi.\n\nAssistant:Hello.</s>", "<s>User: Hi.\n\nAssistant:Hello.</s>",
                 "Hello.</s>"),
    "deepseek3": ("<s>Be brief.<｜User｜>Hi.<｜Assistant｜>Hello.</s>", "<s><｜User｜>Hi.<｜Assistant｜>Hello.</s>",
                  "Hello.</s>"),
    # no end-of-turn text: the eos token ends the conversation (and is what follows each assistant turn's content)
    "glm4": ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi.<|assistant|>\nHello.",
             "[gMASK]<sop><|user|>\nHi.<|assistant|>\nHello.", "\nHello.</s>"),
    "yi": (CHATML_SYSTEM + CHATML, CHATML, "Hello.<|im_end|>\n"),
    "baichuan2": ("Be brief.<reserved_106>Hi.<reserved_107>Hello.", "<reserved_106>Hi.<reserved_107>Hello.",
                  "Hello.</s>"),
    "intern2": ("<s>" + CHATML_SYSTEM + CHATML, "<s><|im_start|>system\n" + INTERN_DEFAULT + "<|im_end|>\n" + CHATML,
                "Hello.<|im_end|>\n"),
    "cohere": ("<s><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>" + COHERE,
               "<s>" + COHERE, "Hello.</s>"),
}

# glaive-like: one call, one observation, a final answer
TOOLS = [{"name": "get_weather", "description": "Get the weather.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"role": "tool", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "It is 20."},
]
QWEN_TOOLS_SYSTEM = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'

# A ChatML template that takes tools (Qwen2.5's, shortened)
QWEN25_TOOLS_TEMPLATE = (
    r"{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    r"{%- else %}{%- set system = 'You are Qwen, a helpful assistant.' %}{%- endif %}"
    r"{{- '<|im_start|>system\n' + system }}{%- if tools %}{{- '\n\n# Tools\n<tools>' }}"
    r"{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}{{- '\n</tools>' }}{%- endif %}"
    r"{{- '<|im_end|>\n' }}"
    r"{%- for message in messages %}"
    r"{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    r"{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}{%- for call in message.tool_calls %}"
    r"{{- '\n<tool_call>\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    r" + '\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    r"{%- elif message.role == 'tool' %}"
    r"{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    r"{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# ChatML without a tool format
PLAIN_CHATML_TEMPLATE = (
    r"{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Qwen3-style: the empty thought goes on the generation prompt when enable_thinking is false
NOTHINK_TEMPLATE = (
    r"{%- set think = '<think>\n\n</think>\n\n' if enable_thinking is defined and not enable_thinking else '' %}"
    r"{%- if tools %}{{- tools | tojson }}{%- endif %}"
    r"{%- for m in messages %}{%- if m.role == 'assistant' %}"
    r"{{- '<|im_start|>assistant\n' + think + m.content + (m.tool_calls | tojson if m.tool_calls else '')"
    r" + '<|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' + think }}{%- endif %}"
)
# Qwen3's own way: reasoning only on the last assistant turn, so earlier text changes as the conversation grows
QWEN3_UNSTABLE_TEMPLATE = (
    r"{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    r"{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
LLAMA_TEMPLATE = (
    r"{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content + "
    r"'<|eot_id|>' }}{%- endfor %}"
)


@pytest.fixture(scope="session")
def tokenizer():
    tok = train_tokenizer(SENTENCES)
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})  # distinct from ChatML's markers
    return tok


def rendered(tokenizer, template: ChatTemplate, messages, tools=None) -> tuple[str, list[str]]:
    input_ids, labels = template.encode(messages, tools=tools)
    if template.own or not FORMATS[template.name].efficient_eos:
        spans = trained_spans(tokenizer, input_ids, labels)
    else:  # the eos label of a turn's end sits on the next turn's first token
        spans = [tokenizer.decode(run, skip_special_tokens=False) for run in label_runs(labels)]
    return tokenizer.decode(input_ids, skip_special_tokens=False), spans


def label_runs(labels: list[int]) -> list[list[int]]:
    runs: list[list[int]] = [[]]
    for label in labels:
        if label != IGNORE_INDEX:
            runs[-1].append(label)
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_format_renders_as_llamafactory(tokenizer, name):
    with_system, without_system, trained = EXPECTED[name]
    eos = "</s>" if FORMATS[name].efficient_eos else ""
    template = ChatTemplate(tokenizer, name)
    assert template.description == f"{name} (written out)"
    assert rendered(tokenizer, template, SYSTEM + CHAT) == (with_system + eos, [trained])
    assert rendered(tokenizer, template, CHAT) == (without_system + eos, [trained])


@pytest.mark.parametrize("name, second_user, turn", [("glm4", "<|user|>\nBye.", "\n{}</s>"),
                                                     ("baichuan2", "<reserved_106>Bye.", "{}</s>")])
def test_formats_without_an_end_of_turn_train_eos_after_every_assistant_turn(tokenizer, name, second_user, turn):
    """LLaMA-Factory's efficient_eos: the label of the first token after an assistant turn is the eos token (the
    turn ends there), and the eos token closes the conversation."""
    two_rounds = CHAT + [{"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Goodbye."}]
    input_ids, labels = ChatTemplate(tokenizer, name).encode(two_rounds)
    eos = tokenizer.eos_token_id
    ends = [i for i, label in enumerate(labels) if label == eos]
    assert len(ends) == 2 and ends[1] == len(input_ids) - 1 and input_ids[-1] == eos
    assert tokenizer.decode(input_ids[ends[0]:], skip_special_tokens=False).startswith(second_user)
    assert [tokenizer.decode(run, skip_special_tokens=False) for run in label_runs(labels)] == [
        turn.format("Hello."), turn.format("Goodbye.")]


def test_glm4_tools_and_calls_as_llamafactory_writes_them(tokenizer):
    text, trained = rendered(tokenizer, ChatTemplate(tokenizer, "glm4"), TOOL_CHAT, TOOLS)
    tools_text = ("你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
                  "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具\n\n## get_weather\n\n"
                  + json.dumps(TOOLS[0], indent=4, ensure_ascii=False)
                  + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。")
    call = 'get_weather\n{"city": "Paris"}'
    assert text == ("[gMASK]<sop><|system|>\n" + tools_text + "<|user|>\nWeather in Paris?<|assistant|>" + call
                    + '<|observation|>\n{"temp": 20}<|assistant|>\nIt is 20.</s>')
    assert trained == [call + "</s>", "\nIt is 20.</s>"]
    parallel = copy.deepcopy(TOOL_CHAT)
    parallel[1]["tool_calls"] *= 2
    with pytest.raises(DataError, match="GLM-4 takes one tool call a turn"):
        ChatTemplate(tokenizer, "glm4").encode(parallel, tools=TOOLS)


def test_every_config_name_has_a_format():
    assert set(EXPECTED) == set(FORMATS) == set(TEMPLATE_NAMES)  # the config's names are the formats rendered


@pytest.mark.parametrize("page", ["README.md", "docs/migration.md"])
def test_the_docs_name_every_template_the_config_takes(page):
    """The key list (README) and the LLaMA-Factory key table (migration) name the registry's templates, no other."""
    row = next(line for line in (Path(__file__).parents[1] / page).read_text().splitlines()
               if line.startswith("| `template` |"))
    listed = row.split(": ours")[0] if page == "docs/migration.md" else row
    names = {name for name in re.findall(r"`([a-z0-9_]+)`", listed)} - {"template", "auto", "tokenizer"}
    assert names == set(TEMPLATE_NAMES)


def test_qwen3_keeps_reasoning_that_is_there(tokenizer):
    messages = [CHAT[0], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nHello."}]
    assert rendered(tokenizer, ChatTemplate(tokenizer, "qwen3"), messages)[1] == [
        "<think>\nEasy.\n</think>\n\nHello.<|im_end|>\n"]


def test_leading_assistant_trains_after_the_default_system(tokenizer):
    text, trained = rendered(tokenizer, ChatTemplate(tokenizer, "alpaca"), CHAT[::-1])
    assert text == ALPACA_DEFAULT + "### Response:\nHello.</s>\n\n### Instruction:\nHi.\n\n"
    assert trained == ["Hello.</s>\n\n"]


def test_qwen_tool_call(tokenizer):
    text, trained = rendered(tokenizer, ChatTemplate(tokenizer, "qwen"), TOOL_CHAT, TOOLS)
    assert text == (
        QWEN_TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n" + QWEN_CALL
        + '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nIt is 20.<|im_end|>\n"
    )
    assert trained == [QWEN_CALL, "It is 20.<|im_end|>\n"]  # the call and the answer, not the observation


def test_tool_calls_in_chat_template_form_render_the_same(tokenizer):
    hf_form = copy.deepcopy(TOOL_CHAT)
    hf_form[1]["tool_calls"] = [{"type": "function", "function": call} for call in hf_form[1]["tool_calls"]]
    tools = [{"type": "function", "function": tool} for tool in TOOLS]
    template = ChatTemplate(tokenizer, "qwen")
    assert template.encode(hf_form, tools=tools) == template.encode(TOOL_CHAT, tools=TOOLS)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_trains_calls_not_observations(tokenizer, name):
    text, trained = rendered(tokenizer, ChatTemplate(tokenizer, name), TOOL_CHAT, TOOLS)
    assert "get_weather" in text.split("Weather in Paris?")[0]  # the tools come before the conversation
    assert len(trained) == 2 and "Paris" in trained[0] and "It is 20." in trained[1]
    assert not any("temp" in span for span in trained)


def test_tokenizer_own_template_without_tool_format_refuses_tools(tokenizer):
    template = ChatTemplate(with_template(tokenizer, PLAIN_CHATML_TEMPLATE), "tokenizer")
    assert not template.takes_tools
    with pytest.raises(DataError, match=r"has no tool format.*take tools: chatml, qwen, qwen3"):
        template.encode(TOOL_CHAT, tools=TOOLS)
    assert template.encode(CHAT)  # conversations without tools still train


LF_EXPECTED = json.loads((FIXTURES / "llamafactory.json").read_text())["templates"]
QWEN25_INSTRUCT = (FIXTURES / "qwen2.5_instruct.jinja").read_text()  # Qwen2.5-Instruct's chat template


@pytest.mark.parametrize("own", [None, QWEN25_INSTRUCT, PLAIN_CHATML_TEMPLATE, NOTHINK_TEMPLATE,
                                 QWEN3_UNSTABLE_TEMPLATE, LLAMA_TEMPLATE],
                         ids=["none", "qwen2.5", "plain-chatml", "enable-thinking", "qwen3-style", "llama"])
@pytest.mark.parametrize("name", sorted(LF_EXPECTED))
def test_a_named_template_renders_as_llamafactory_whatever_the_tokenizer_has(tokenizer, name, own):
    """LLaMA-Factory's text and trained spans (a fixture from its register_template entries), on a tokenizer with
    no template, Qwen2.5's (its default system prompt), plain ChatML, one taking enable_thinking, a Qwen3-style one
    and another family's."""
    template = ChatTemplate(tokenizer if own is None else with_template(tokenizer, own), name)
    for case in LF_EXPECTED[name]:
        assert rendered(tokenizer, template, case["messages"]) == (case["text"], case["trained"]), template.description


@pytest.mark.parametrize("name", ["qwen3", "qwen3_nothink", "yi", "chatml"])
def test_a_named_template_is_not_the_tokenizers_own_when_that_renders_other_text(tokenizer, name):
    template = ChatTemplate(with_template(tokenizer, QWEN25_INSTRUCT), name)
    assert (template.own, template.description) == (False, f"{name} (written out)")
    assert serving_chat_template(with_template(tokenizer, QWEN25_INSTRUCT), name) == template.jinja


def test_the_tokenizers_own_stands_in_where_it_renders_the_same(tokenizer):
    """Qwen2.5's template renders LLaMA-Factory's qwen (default system prompt and tools included): it is used, so
    final/ keeps the model's own template."""
    tok = with_template(tokenizer, QWEN25_INSTRUCT)
    template = ChatTemplate(tok, "qwen")
    assert (template.own, template.description) == (True, "qwen (the tokenizer's own, which renders it the same)")
    assert serving_chat_template(tok, "qwen") is None
    assert rendered(tok, template, TOOL_CHAT, TOOLS) == rendered(tokenizer, ChatTemplate(tokenizer, "qwen"),
                                                                 TOOL_CHAT, TOOLS)


def test_a_template_that_differs_only_in_tools_is_not_the_same(tokenizer):
    tok = with_template(tokenizer, QWEN25_TOOLS_TEMPLATE.replace("You are Qwen, a helpful assistant.",
                                                                  "You are Qwen, created by Alibaba Cloud. You are a "
                                                                  "helpful assistant."))
    template = ChatTemplate(tok, "qwen")
    assert rendered(tok, template, CHAT) == rendered(tokenizer, ChatTemplate(tokenizer, "qwen"), CHAT)
    assert template.description == "qwen (written out)"  # its tool text is not LLaMA-Factory's qwen tool format


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_saved_template_serves_prompts_as_trained(tokenizer, name, tmp_path):
    """final/'s tokenizer, loaded afresh, renders the generation prompt exactly as training did."""
    saved = serving_chat_template(tokenizer, name)
    with_template(tokenizer, saved).save_pretrained(tmp_path)
    served = AutoTokenizer.from_pretrained(tmp_path)
    template = ChatTemplate(tokenizer, name)
    hf_chat = copy.deepcopy(TOOL_CHAT[:3])  # tools and calls as a server passes them
    hf_chat[1]["tool_calls"] = [{"type": "function", "function": call} for call in hf_chat[1]["tool_calls"]]
    hf_tools = [{"type": "function", "function": tool} for tool in TOOLS]
    for messages, served_messages, tools, served_tools in (
        (SYSTEM + CHAT + CHAT[:1], SYSTEM + CHAT + CHAT[:1], None, None),
        (CHAT[:1], CHAT[:1], None, None),
        (TOOL_CHAT[:3], hf_chat, TOOLS, hf_tools),
    ):
        prompt = served.apply_chat_template(served_messages, tools=served_tools, tokenize=False,
                                            add_generation_prompt=True)
        assert prompt == template.render_prompt(messages, tools=tools)
    assert served.apply_chat_template(SYSTEM + CHAT, tokenize=False) == EXPECTED[name][0]  # eos: training only


@pytest.mark.parametrize("own", [None, QWEN25_INSTRUCT], ids=["written-out", "tokenizer's own"])
@pytest.mark.parametrize("name", [None, "qwen", "chatml"])
def test_default_system_replaces_the_templates_default_as_llamafactorys_key_does(tokenizer, tmp_path, name, own):
    """A conversation without a system message (or with an empty one) gets default_system; one with its own keeps
    it; final/'s template serves prompts the same."""
    tok = tokenizer if own is None else with_template(tokenizer, own)
    template = ChatTemplate(tok, name, default_system="Be kind.")
    system = "<|im_start|>system\nBe kind.<|im_end|>\n"
    assert rendered(tokenizer, template, CHAT)[0] == system + CHATML
    assert rendered(tokenizer, template, [{"role": "system", "content": ""}] + CHAT)[0] == system + CHATML
    assert rendered(tokenizer, template, SYSTEM + CHAT) == (CHATML_SYSTEM + CHATML, ["Hello.<|im_end|>\n"])
    assert "Be kind." in template.description
    with_template(tok, serving_chat_template(tok, name, "Be kind.")).save_pretrained(tmp_path)
    served = AutoTokenizer.from_pretrained(tmp_path)
    assert served.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True) == \
        template.render_prompt(CHAT[:1]) == system + "<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
