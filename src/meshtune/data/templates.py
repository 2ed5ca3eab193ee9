"""LLaMA-Factory's chat formats, written out as jinja chat templates.

Each `Format` (config/chat_formats.py, the registry the config's `template` names come from) copies one
`register_template` entry of LLaMA-Factory (data/template.py, with its tool formats from data/tool_utils.py), so a
config that names a LLaMA-Factory template trains on the same text. `template_jinja` turns a format into one jinja
chat template: that string renders the training data and is saved with the trained model, so serving renders prompts
exactly as training did.
"""

from __future__ import annotations

import re

from meshtune.config.chat_formats import FORMATS

# The formats whose jinja LLaMA-Factory writes into the saved tokenizer in place of its own (replace_jinja_template);
# under the others it keeps the tokenizer's own, whatever text the training rendered
LLAMAFACTORY_SAVES_ITS_FORMAT = ("alpaca", "chatml", "default")

# Per tool format: `tools_text(tools)`, appended to the system prompt, and `calls_text(calls)`, the tool-call turn.
# Both take tools and calls in the form chat templates are given ({"type": "function", "function": ...}) or bare.
_FUNCTION = "{%- set f = tool.function if tool.type == 'function' else tool -%}"
_CALL = "{%- set f = call.function if call.function is defined else call -%}"
_WRAPPED = "(tool if tool.type == 'function' else {'type': 'function', 'function': tool})"
TOOL_FORMATS: dict[str, str] = {
    "qwen": "\n".join([
        "{%- macro tools_text(tools) -%}",
        r"{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}",
        r"{%- for tool in tools -%}{{- '\n' + " + _WRAPPED + r" | tojson -}}{%- endfor -%}",
        r"""{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within """
        r"""<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": """
        r"""<args-json-object>}\n</tool_call>' -}}""",
        "{%- endmacro -%}",
        "{%- macro calls_text(calls) -%}{%- for call in calls -%}" + _CALL,
        r"{{- ('' if loop.first else '\n') + '<tool_call>\n' + {'name': f.name, 'arguments': f.arguments} | tojson"
        r" + '\n</tool_call>' -}}",
        "{%- endfor -%}{%- endmacro -%}",
    ]),
    # LLaMA-Factory writes the day of rendering here; a fixed default (as Llama 3.1's own template has) keeps the
    # tokenized data the same on every node and every day. Serving may pass date_string.
    "llama3": "\n".join([
        "{%- macro tools_text(tools) -%}",
        r"{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + (date_string if date_string is defined "
        r"else '26 Jul 2024') + '\n\nYou have access to the following functions. To call a function, please "
        r"""respond with JSON for a function call. Respond in the format {"name": function name, "parameters": """
        r"""dictionary of argument name and its value}. Do not use variables.\n\n' -}}""",
        r"{%- for tool in tools -%}{{- " + _WRAPPED + r" | tojson(indent=4) + '\n\n' -}}{%- endfor -%}",
        "{%- endmacro -%}",
        "{%- macro calls_text(calls) -%}{{- '' if calls | length == 1 else '[' -}}{%- for call in calls -%}" + _CALL,
        "{{- ('' if loop.first else ', ') + {'name': f.name, 'parameters': f.arguments} | tojson -}}",
        "{%- endfor -%}{{- '' if calls | length == 1 else ']' -}}{%- endmacro -%}",
    ]),
    "mistral": "\n".join([
        "{%- macro tools_text(tools) -%}{{- '[AVAILABLE_TOOLS] [' -}}",
        "{%- for tool in tools -%}{{- ('' if loop.first else ', ') + " + _WRAPPED + " | tojson -}}{%- endfor -%}",
        "{{- '][/AVAILABLE_TOOLS]' -}}{%- endmacro -%}",
        "{%- macro calls_text(calls) -%}{{- '[' -}}{%- for call in calls -%}" + _CALL,
        "{{- ('' if loop.first else ', ') + {'name': f.name, 'arguments': f.arguments} | tojson -}}",
        "{%- endfor -%}{{- ']' -}}{%- endmacro -%}",
    ]),
    "glm4": "\n".join([
        "{%- macro tools_text(tools) -%}",
        "{{- '你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
        r"你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具' -}}",
        "{%- for tool in tools -%}" + _FUNCTION,
        r"{{- '\n\n## ' ~ f.name ~ '\n\n' ~ f | tojson(indent=4) ~ '\n'"
        " ~ '在调用上述函数时，请使用 Json 格式表示调用的参数。' -}}",
        "{%- endfor -%}{%- endmacro -%}",
        "{%- macro calls_text(calls) -%}{%- if calls | length > 1 -%}"
        "{{- raise_exception('GLM-4 takes one tool call a turn, not parallel calls') -}}{%- endif -%}",
        r"{%- for call in calls -%}" + _CALL + r"{{- f.name ~ '\n' ~ f.arguments | tojson -}}{%- endfor -%}",
        "{%- endmacro -%}",
    ]),
    # LLaMA-Factory's generic format, for templates of models without a tool format of their own
    "default": "\n".join([
        "{%- macro tools_text(tools) -%}{%- set ns = namespace(names=[]) -%}",
        r"{{- 'You have access to the following tools:\n' -}}",
        "{%- for tool in tools -%}" + _FUNCTION + "{%- set ns.names = ns.names + [f.name] -%}",
        r"{{- '> Tool Name: ' ~ f.name ~ '\nTool Description: ' ~ (f.description or '') ~ '\nTool Args:\n' -}}",
        "{%- set params = f.parameters or {} -%}{%- for arg, p in (params.properties or {}).items() -%}",
        "{{- '  - ' ~ arg ~ ' (' ~ (p.type or '') ~ (', required' if arg in (params.required or []) else '')"
        " ~ '): ' ~ (p.description or '') -}}",
        "{%- if p.enum -%}{{- ', should be one of [' ~ p.enum | join(', ') ~ ']' -}}{%- endif -%}",
        r"{%- if 'items' in p -%}{{- ', where each item should be ' ~ (p['items'].type or '') -}}{%- endif -%}",
        r"{{- '\n' -}}{%- endfor -%}{{- '\n' -}}{%- endfor -%}",
        r"{{- 'Use the following format if using a tool:\n```\nAction: tool name (one of [' ~ ns.names | join(', ')"
        r""" ~ '])\nAction Input: the input to the tool, in a JSON format representing the kwargs (e.g. ```{"input": """
        r""""hello world", "num_beams": 5}```)\n```\n' -}}""",
        "{%- endmacro -%}",
        "{%- macro calls_text(calls) -%}{%- for call in calls -%}" + _CALL,
        r"{{- ('' if loop.first else '\n') + 'Action: ' ~ f.name ~ '\nAction Input: ' ~ f.arguments | tojson -}}",
        "{%- endfor -%}{%- endmacro -%}",
    ]),
}

_SLOT = re.compile(r"\{(content|bos|eos)\}")
_SPECIAL = {"bos": "(bos_token or '')", "eos": "(eos_token or '')"}


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _expr(slot: str, content: str = "content") -> str:
    """A slot as a jinja expression, `content` naming the variable that fills {content}."""
    parts = []
    for i, piece in enumerate(_SLOT.split(slot)):
        if i % 2:
            parts.append(content if piece == "content" else _SPECIAL[piece])
        elif piece:
            parts.append(_quote(piece))
    return " + ".join(parts)


def _emit(slot: str, content: str = "content") -> str:
    return "{{- " + _expr(slot, content) + " -}}" if slot else ""


def template_jinja(name: str, default_system: str | None = None) -> str:
    """The jinja chat template of format `name`; it reads messages, tools, add_generation_prompt, bos/eos_token.

    As in LLaMA-Factory's training: the system prompt is the first message's or else the default one (the format's,
    or `default_system` in its place, as LLaMA-Factory's key replaces it), with the tools appended to it; a
    tool-call turn is its text content followed by the calls.
    """
    f = FORMATS[name]
    default = f.default_system if default_system is None else default_system
    system_block = f"{{%- if system -%}}{_emit(f.system, 'system')}{{%- endif -%}}"
    thought = ("{%- if '<think>' not in content and '</think>' not in content -%}"
               r"{%- set content = '<think>\n\n</think>\n\n' + content -%}{%- endif -%}")
    lines = [
        TOOL_FORMATS[f.tools],
        "{%- set has_system = messages and messages[0].role == 'system' -%}",
        "{%- set loop_messages = messages[1:] if has_system else messages -%}",
        f"{{%- set system = (messages[0].content if has_system else '') or {_quote(default)} -%}}",
        "{%- if tools -%}{%- set system = system + tools_text(tools) -%}{%- endif -%}",
        _emit(f.prefix),
        "" if f.system_in_first_user else system_block,
        "{%- for message in loop_messages -%}",
        "{%- set content = message.content or '' -%}",
        "{%- if message.role == 'user' -%}",
        (f"{{%- if loop.first and system -%}}{{%- set content = {_expr(f.system, 'system')} + content -%}}"
         "{%- endif -%}" if f.system_in_first_user else ""),
        _emit(f.user),
        "{%- elif message.role == 'tool' -%}",
        _emit(f.observation or f.user),
        "{%- elif message.role == 'assistant' -%}",
        _emit(f.header),
        thought if f.empty_thought else "",
        "{%- if message.tool_calls -%}{%- set content = content + calls_text(message.tool_calls) -%}",
        _emit(f.function or f.assistant),
        "{%- else -%}",
        _emit(f.assistant),
        "{%- endif -%}",
        "{%- else -%}",
        f"{{{{- raise_exception('template {name} has no format for a ' ~ message.role ~ ' message here; messages are "
        "user, assistant and tool, with a system message only first') -}}",
        "{%- endif -%}",
        "{%- endfor -%}",
        f"{{%- if add_generation_prompt -%}}{_emit(f.header)}{{%- endif -%}}" if f.header else "",
    ]
    return "\n".join(line for line in lines if line)


def with_default_system(jinja: str, default_system: str) -> str:
    """`jinja` (any chat template) rendering `default_system` as the system message of a conversation without one
    (or with an empty one), as LLaMA-Factory's default_system does."""
    return ("{%- if not (messages and messages[0].role == 'system' and messages[0].content) -%}"
            "{%- set messages = [{'role': 'system', 'content': " + _quote(default_system) + "}] + "
            "(messages[1:] if messages and messages[0].role == 'system' else messages) -%}{%- endif -%}\n" + jinja)
