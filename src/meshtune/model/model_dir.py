"""A local Hugging Face model directory: what it must hold, checked before anything reads it, and its tokenizer.
Apart from model/loading.py, so that a launcher checks the directory and tokenizes the data without importing the
model classes (seconds a process)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from meshtune.errors import ModelError
from meshtune.model.custom_code import refuse_custom_code

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str | Path) -> Path:
    """Name exactly what is missing, instead of letting transformers try the hub."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ModelError(
            f"model_name_or_path: {path} is not a local directory. meshtune never downloads: fetch the model "
            f"first (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and point model_name_or_path at DIR")
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(any(directory.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    missing += [problem for weights in sorted(directory.glob("*.safetensors"))
                if (problem := safetensors_problem(weights))]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing += [f"shard {name} listed in {index.name}" for name in sorted(shards)
                    if not (directory / name).is_file()]
    if missing:
        raise ModelError(f"model directory {directory} is incomplete or damaged: " + "; ".join(
            item if " is " in item else f"missing {item}" for item in missing) + ". Copy or download it again")
    check_not_prequantized(directory)
    refuse_custom_code(directory)
    return directory


def check_not_prequantized(directory: Path) -> None:
    """A model released quantized (AWQ, GPTQ, AQLM, bitsandbytes, ... : config.json has a quantization_config)
    holds packed integer weights that only their quantizer's kernels read; meshtune reads the floating-point
    weights and quantizes them itself (Q-LoRA), so such a model is named here, before any tokenizing."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except ValueError as error:
        raise ModelError(f"{directory / 'config.json'} is not valid JSON ({error}); copy or download it "
                         f"again") from None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not quantization:
        return
    method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unnamed"
    bits = quantization.get("bits") if isinstance(quantization, dict) else None
    raise ModelError(
        f"model_name_or_path: {directory} is a pre-quantized model (config.json quantization_config: quant_method "
        f"{method}{f', {bits} bits' if bits else ''}): meshtune trains from a model's unquantized weights and "
        f"quantizes them itself. Point model_name_or_path at the unquantized base (the same model without the "
        f"-AWQ / -GPTQ / -Int4 / -bnb-4bit suffix) and set finetuning_type: qlora: meshtune stores its frozen "
        f"weights in 4-bit NF4, about the memory of the quantized model")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors file, read from its header alone (cheap for any size): truncated, or
    not safetensors at all; None when its size matches what the header describes."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                return (f"{path.name} is truncated or not a safetensors file ({size:,} bytes, less than the "
                        f"{header_len + 8:,} its first bytes announce)")
            header = json.loads(f.read(header_len))
        data_end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return f"{path.name} is not a readable safetensors file (its header does not parse)"
    if 8 + header_len + data_end > size:
        return f"{path.name} is truncated: {size:,} bytes, its header describes {8 + header_len + data_end:,}"
    return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    refuse_custom_code(path)  # never prompted for, never run
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        # Llama-style tokenizers ship without one; padding is masked out of the loss and attention anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
