"""The `--key value` form of HF-style training scripts (Qwen's finetune.py and its shell scripts), read as keys.

`--bf16 True`, `--bf16` (alone: true), `--learning_rate 1e-5`, `--key=value` and `--lora_target_modules a b c`
(several values: a list) are all accepted; values are parsed as YAML, as `key=value` overrides are, which may
stand before, between or after the flags. A flag's values end at the next option, `--flag` or the command's own
`-n 1`; a negative number (`--max_steps -1`) is a value.
"""

from __future__ import annotations

import re
from typing import Any

from meshtune.config import parse_overrides


OVERRIDE = re.compile(r"[A-Za-z_]\w*=")  # a key=value override, never a flag's value
NUMBER = re.compile(r"-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")  # `--max_steps -1`: a value, not an option


def is_option(token: str) -> bool:
    """`--flag`, or a short option of the command (`-n 1`): it ends the values of the flag before it."""
    return token.startswith("-") and token != "-" and not NUMBER.fullmatch(token)


def split_flags(tokens: list[str], own: set[str]) -> tuple[list[str], dict[str, Any], list[str]]:
    """(the tokens that are not flags, the flags as keys and values, the flag tokens as given). `own` are the
    command's own options (`--debug`, `--nodes 2` or `--nodes=2`), left in place."""
    rest: list[str] = []
    flags: dict[str, Any] = {}
    given: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token.partition("=")[0] in own or token == "--":
            rest.append(token)
            i += 1
            continue
        name, sep, inline = token[2:].partition("=")
        raw = [inline] if sep else []
        i += 1
        while not sep and i < len(tokens) and not is_option(tokens[i]) and not OVERRIDE.match(tokens[i]):
            raw.append(tokens[i])
            i += 1
        given += [token, *([] if sep else raw)]
        values = [parse_overrides([f"v={part}"])["v"] for part in raw]
        flags[name.replace("-", "_")] = True if not values else values[0] if len(values) == 1 else values
    return rest, flags, given
