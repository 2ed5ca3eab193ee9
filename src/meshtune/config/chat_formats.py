"""The chat formats a config's `template` names: LLaMA-Factory's `register_template` entries, one `Format` each,
by the names LLaMA-Factory gives them, ChatML first.

This registry is the one list of template names: the config's `template` key takes its names, and data/templates.py
writes each format out as a jinja chat template.

Slots take `{content}`, `{bos}` and `{eos}` (the tokenizer's own bos/eos strings). LLaMA-Factory puts the assistant
header at the end of the user and tool formats; here it is `header`, written before each assistant turn and as the
generation prompt, which renders the same text for conversations that alternate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    user: str
    assistant: str
    system: str = "{content}"
    header: str = ""  # the assistant header, not trained
    observation: str = ""  # a tool result; the user format when empty
    function: str = ""  # a tool-call turn; the assistant format when empty
    tools: str = "default"  # key of TOOL_FORMATS
    prefix: str = ""
    default_system: str = ""
    system_in_first_user: bool = False  # llama2 / mistral fold the system prompt into the first user turn
    empty_thought: bool = False  # qwen3: an assistant turn without reasoning gets an empty, trained <think></think>
    # glm4, baichuan2 (LLaMA-Factory's efficient_eos): an assistant turn has no end marker of its own; the eos token
    # is trained after each one (as the label of the next turn's first token) and appended to the conversation
    efficient_eos: bool = False


_CHATML = dict(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n",
    header="<|im_start|>assistant\n",
    assistant="{content}<|im_end|>\n",
)
_QWEN = dict(
    _CHATML,
    observation="<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n",
    tools="qwen",
)

_GEMMA = dict(  # gemma, gemma3: the system prompt folded into the first user turn
    prefix="{bos}",
    system="{content}\n\n",
    user="<start_of_turn>user\n{content}<end_of_turn>\n",
    header="<start_of_turn>model\n",
    assistant="{content}<end_of_turn>\n",
    observation="<start_of_turn>tool\n{content}<end_of_turn>\n",
    system_in_first_user=True,
)

FORMATS: dict[str, Format] = {
    "chatml": Format(**_CHATML, observation="<|im_start|>tool\n{content}<|im_end|>\n"),
    "qwen": Format(**_QWEN, default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": Format(**_QWEN, empty_thought=True),
    "qwen3_nothink": Format(**_QWEN),
    "llama3": Format(
        prefix="{bos}",
        system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
        header="<|start_header_id|>assistant<|end_header_id|>\n\n",
        assistant="{content}<|eot_id|>",
        observation="<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>",
        tools="llama3",
    ),
    "llama2": Format(
        user="{bos}[INST] {content} [/INST]",
        assistant="{content}{eos}",
        system="<<SYS>>\n{content}\n<</SYS>>\n\n",
        system_in_first_user=True,
    ),
    "mistral": Format(
        prefix="{bos}",
        user="[INST] {content}[/INST]",
        assistant=" {content}{eos}",
        system="{content}\n\n",
        function="[TOOL_CALLS] {content}{eos}",
        observation='[TOOL_RESULTS] {"content": {content}}[/TOOL_RESULTS]',
        tools="mistral",
        system_in_first_user=True,
    ),
    "gemma": Format(**_GEMMA),
    "gemma3": Format(**_GEMMA),
    "phi": Format(
        system="<|system|>\n{content}<|end|>\n",
        user="<|user|>\n{content}<|end|>\n",
        header="<|assistant|>\n",
        assistant="{content}<|end|>\n",
    ),
    "phi4": Format(
        system="<|im_start|>system<|im_sep|>{content}<|im_end|>",
        user="<|im_start|>user<|im_sep|>{content}<|im_end|>",
        header="<|im_start|>assistant<|im_sep|>",
        assistant="{content}<|im_end|>",
    ),
    "deepseek": Format(
        prefix="{bos}",
        system="{content}\n\n",
        user="User: {content}\n\n",
        header="Assistant:",
        assistant="{content}{eos}",
    ),
    "deepseek3": Format(
        prefix="{bos}",
        user="<｜User｜>{content}",
        header="<｜Assistant｜>",
        assistant="{content}{eos}",
    ),
    "glm4": Format(
        prefix="[gMASK]<sop>",
        system="<|system|>\n{content}",
        user="<|user|>\n{content}",
        header="<|assistant|>",
        assistant="\n{content}",
        function="{content}",
        observation="<|observation|>\n{content}",
        tools="glm4",
        efficient_eos=True,
    ),
    "yi": Format(**_CHATML),
    # LLaMA-Factory dropped baichuan2 as obsolete; this is its last definition there
    "baichuan2": Format(user="<reserved_106>{content}", header="<reserved_107>", assistant="{content}",
                        efficient_eos=True),
    "intern2": Format(
        **_CHATML,
        prefix="{bos}",
        default_system="You are an AI assistant whose name is InternLM (书生·浦语).\n"
                       "- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI "
                       "Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.\n"
                       "- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the "
                       "user such as English and 中文.",
    ),
    "cohere": Format(
        prefix="{bos}",
        system="<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        user="<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        header="<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        assistant="{content}{eos}",
    ),
    "default": Format(
        system="System: {content}{eos}\n",
        user="Human: {content}{eos}\n",
        header="Assistant:",
        assistant="{content}{eos}\n",
    ),
    "empty": Format(user="{content}", assistant="{content}"),
    "alpaca": Format(
        user="### Instruction:\n{content}\n\n",
        header="### Response:\n",
        assistant="{content}{eos}\n\n",
        default_system="Below is an instruction that describes a task. "
                       "Write a response that appropriately completes the request.\n\n",
    ),
}

TEMPLATE_NAMES = tuple(FORMATS)
