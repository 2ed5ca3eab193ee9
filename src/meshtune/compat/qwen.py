"""Qwen's finetune.py defaults for a job given in its flags, so its scripts train what finetune.py would train.

finetune.py (QwenLM/Qwen) trains every parameter unless `--use_lora` is given, and its LoRA defaults are not
meshtune's: r 64, alpha 16, dropout 0.05, on c_attn, c_proj, w1 and w2 (every linear layer of its blocks:
meshtune's `lora_target: all`); without `--q_lora`, a model whose path does not say "chat" also trains its
embedding (`wte`) and output head (`lm_head`) in full. Its `preprocess` renders every conversation in ChatML
with the system prompt "You are a helpful assistant." (whatever chat template the tokenizer has): here
`template: chatml` with that `default_system`. A job is read as finetune.py's when it gives a key only
finetune.py has (`--data_path`, `--model_max_length`, `--use_lora`, ...); a key given explicitly, in its Qwen or
meshtune name, always wins over these defaults.
"""

from __future__ import annotations

from typing import Any

from meshtune.compat.foreign import FOREIGN, QWEN

QWEN_KEYS = tuple(key for key, (whose, _) in FOREIGN.items() if whose == QWEN)
LORA_DEFAULTS = {"lora_rank": 64, "lora_alpha": 16.0, "lora_dropout": 0.05, "lora_target": ["all"]}
BASE_MODEL_MODULES = ["wte", "lm_head"]  # Qwen's embedding and head: model/lora.py finds them in any model
SYSTEM_PROMPT = "You are a helpful assistant."  # finetune.py's preprocess(system_message=...)
# finetune.py's labels also train each turn's <|im_start|> and the <|im_end|>\n of system and user turns
MASKING_NOTE = (r"Qwen's finetune.py also trains each turn's <|im_start|> and the <|im_end|>\n ending its system and "
                r"user turns; meshtune trains the assistant replies and their <|im_end|>\n only (train_on_prompt: "
                r"true trains every turn whole)")


def qwen_keys_given(values: dict[str, Any]) -> list[str]:
    """The keys of `values` that only Qwen's finetune.py has: they make the job a finetune.py job."""
    return [key for key in QWEN_KEYS if key in values]


def finetune_py_defaults(values: dict[str, Any], sources: dict[str, str], default_source: str
                         ) -> tuple[dict[str, Any], list[str], list[str]]:
    """(finetune.py's defaults for what `values` (raw, Qwen's names not yet translated) leaves unset, notes saying
    which applied and what meshtune does otherwise, problems). Nothing for a job that gives no key only
    finetune.py has."""
    given = qwen_keys_given(values)
    if not given:
        return {}, [], []
    use_lora, q_lora = values.get("use_lora") is True, values.get("q_lora") is True
    if q_lora and not use_lora and "finetuning_type" not in values:
        return {}, [], [f"{sources.get('q_lora', default_source)}: q_lora: True without use_lora: finetune.py "
                          f"then ignores q_lora and trains every parameter of the unquantized model; add --use_lora "
                          f"True for Q-LoRA, or drop --q_lora to train every parameter"]
    defaults: dict[str, Any] = {}
    if not use_lora and "finetuning_type" not in values:
        defaults["finetuning_type"] = "full"
    if use_lora or values.get("finetuning_type") in ("lora", "qlora"):
        aliases = {"lora_rank": "lora_r", "lora_target": "lora_target_modules"}
        defaults.update({key: value for key, value in LORA_DEFAULTS.items()
                         if key not in values and aliases.get(key) not in values})
        # finetune.py: `modules_to_save = None if q_lora or 'chat' in model_name_or_path.lower()`
        chat = "chat" in str(values.get("model_name_or_path", "")).lower()
        quantized = q_lora or values.get("finetuning_type") == "qlora" or "quantization_bit" in values
        if not (chat or quantized or "additional_target" in values):
            defaults["additional_target"] = BASE_MODEL_MODULES
    if "template" not in values and "default_system" not in values:  # finetune.py's preprocess: ChatML, one prompt
        defaults.update(template="chatml", default_system=SYSTEM_PROMPT)
    notes = [] if values.get("train_on_prompt") is True else [MASKING_NOTE]
    if not defaults:
        return {}, notes, []
    shown = ", ".join(f"{key}: {_show(value)}{WHY.get(key, '')}" for key, value in defaults.items())
    return defaults, [f"Qwen's finetune.py flags ({', '.join(given)}): its defaults apply where no flag sets them: "
                      f"{shown}", *notes], []


WHY = {"finetuning_type": " (without --use_lora finetune.py trains every parameter)",
       "additional_target": " (the model's path does not say 'chat': finetune.py trains its embedding and output head "
                            "in full; additional_target= turns that off)",
       "default_system": " (finetune.py renders every conversation in ChatML after that system prompt, whatever the "
                         "tokenizer's chat template)"}


def _show(value: Any) -> str:
    if isinstance(value, str) and " " in value:
        return repr(value)
    return ",".join(value) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)
