"""Load a model from a local Hugging Face directory (checked by model/model_dir.py); never from the network."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from meshtune.errors import ModelError
from meshtune.model.custom_code import refuse_custom_code
from meshtune.plan import ModelSize


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """fp32 master weights; bf16 compute comes from autocast (DDP) or FSDP2's MixedPrecisionPolicy."""
    refuse_custom_code(path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa", trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the model in {path}: {exc}") from None


def model_size(path: str | Path) -> ModelSize:
    """Parameters of the model in `path` and of one of its transformer blocks, its heads and type, from its config alone
    (no weights)."""
    model = model_skeleton(path)
    blocks = transformer_blocks(model)
    config = model.config
    return ModelSize(sum(p.numel() for p in model.parameters()), sum(p.numel() for p in blocks[0].parameters()),
                     len(blocks), attention_heads=getattr(config, "num_attention_heads", 0) or 0,
                     kv_heads=getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 0),
                     model_type=config.model_type, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     hidden=getattr(config, "hidden_size", 0) or 0,
                     head_parameters=head.weight.numel() if (head := model.get_output_embeddings()) is not None else 0)


def model_skeleton(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model of `path` built on the meta device: its modules, names, shapes and dtypes, and no weights (the
    processes that receive rank 0's weights instead of reading the files)."""
    refuse_custom_code(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                trust_remote_code=False)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers, found by the class names HF models list in `_no_split_modules` (FSDP2 swaps a
    sharded module's class for a subclass named FSDP<name>, so the class's bases count too)."""
    base = getattr(model, "get_base_model", lambda: model)()
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if any(cls.__name__ in names for cls in type(module).__mro__)]
    if not blocks:
        raise ModelError(f"cannot find the transformer blocks of {type(base).__name__} (none of its modules is one of "
                         f"its _no_split_modules)")
    return blocks
