"""A model folder whose config or tokenizer names code of its own (`auto_map`, e.g. Qwen(1)'s configuration_qwen.py):
meshtune never runs it. transformers would ask on a terminal whether to run it (and run it on "y"); meshtune refuses
such a folder by name before anything loads it, and every load passes trust_remote_code=False besides. Reads JSON
only, so the launcher checks it before importing torch or transformers."""

from __future__ import annotations

import json
from pathlib import Path

from meshtune.errors import ModelError

AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")
# model_type of a custom-code model -> the same model in an architecture transformers has built in
NATIVE = {
    "qwen": "for Qwen (model_type qwen) that is its successor in transformers' Qwen2 architecture (model_type qwen2): "
            "Qwen1.5 (Qwen/Qwen1.5-7B-Chat for Qwen-7B-Chat), Qwen2 or Qwen2.5",
    "chatglm": "for ChatGLM / GLM-4 (model_type chatglm) that is the '-hf' release in transformers' GLM architecture "
               "(e.g. THUDM/glm-4-9b-chat-hf)",
}


def auto_maps(directory: Path) -> dict[str, dict]:
    """Each of config.json / tokenizer_config.json of `directory` that names code of the folder: its auto_map."""
    found = {}
    for name in AUTO_MAP_FILES:
        try:
            data = json.loads((directory / name).read_text())
        except (OSError, ValueError):  # missing or damaged: check_model_dir names that
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            found[name] = data["auto_map"]
    return found


def refuse_custom_code(path: str | Path, key: str = "model_name_or_path") -> None:
    """A ModelError naming the folder's auto_map and what to use instead, for a folder with code of its own."""
    directory = Path(path).expanduser()
    found = auto_maps(directory)
    if not found:
        return
    named = "; ".join(f"{name} auto_map: " + (", ".join(f"{cls} -> {_classes(to)}" for cls, to in entries.items())
                                                if isinstance(entries, dict) else str(entries))
                      for name, entries in found.items())
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    native = NATIVE.get(model_type, "many models publish one (often named with an '-hf' suffix); otherwise convert "
                                    "the weights to an architecture transformers has")
    raise ModelError(
        f"{key}: {directory} is a custom-code model ({named}): its classes are Python files in the folder, and "
        f"meshtune never runs a model folder's code (every load passes trust_remote_code=False; trust_remote_code: "
        f"true is not honoured). Use a checkpoint of the same model in an architecture transformers has built in, "
        f"whose config.json has no auto_map: {native}")


def _classes(target) -> str:
    """An auto_map entry: "module.Class", or a tokenizer's [slow, fast] pair (either may be null)."""
    if isinstance(target, (list, tuple)):
        return " / ".join(str(t) for t in target if t)
    return str(target)
