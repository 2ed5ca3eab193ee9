"""`meshtune export`: a training output as what serving stacks load.

A full fine-tuning checkpoint: a Hugging Face model directory (export/full_weights.py). LoRA / Q-LoRA, without
`--merge`: the PEFT adapter directory (from `final/` or any `checkpoint-N`). With `--merge`: the adapters
folded into the base model's own weights, read from its original safetensors files (bf16 as released, not a
4-bit copy), written file by file with the same names and index, so a model of any size merges in the memory of
its largest tensor plus one output file.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from meshtune.checkpoint.manifest import MANIFEST, read_manifest
from meshtune.errors import MeshtuneError
from meshtune.export.adapters import PEFT_PREFIX, Adapters, read_adapters
from meshtune.export.full_weights import (DTYPES, base_dtype, export_full_checkpoint, full_checkpoint_base,
                                          is_full_checkpoint, write_model_config)
from meshtune.model.custom_code import refuse_custom_code
from meshtune.model.final_weights import export_kind

HEAD = "lm_head.weight"  # the output head's weight in transformers' causal LM files


def source_of(path: Path, note: Callable[[str], None] = print) -> Path:
    """An output_dir means its final/ when that is complete, else its newest complete checkpoint (`note` says so in
    one line); anything else is taken as given."""
    from meshtune.checkpoint import final_problems
    from meshtune.checkpoint.resume import list_checkpoints

    if not path.is_dir():
        raise MeshtuneError(f"{path} does not exist; give a run's output_dir, its final/ or a checkpoint-N")
    final = path / "final"
    problems = final_problems(final) if final.is_dir() else []
    if final.is_dir() and not problems:
        return final
    complete = [info.path for info in list_checkpoints(path) if info.complete]
    if not complete:
        if problems:
            raise MeshtuneError(f"{final} is not a complete final export ({'; '.join(problems)}) and {path} holds no "
                                f"complete checkpoint; to export that final/ as it is, give {final} itself")
        return path
    why = f"{final} is incomplete ({'; '.join(problems)})" if problems else f"{path} has no final/"
    note(f"meshtune: {why}: exporting {complete[-1].name}, the newest complete checkpoint")
    return complete[-1]


def prepare_output(output: Path, force: bool) -> None:
    if output.exists() and any(output.iterdir()):
        if not force:
            raise MeshtuneError(f"{output} is not empty; choose another --output or add --force to replace it")
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)


def export(source: Path, output: Path, merge: bool, dtype: str | None, force: bool,
           base_model: str | None = None, note: Callable[[str], None] = print) -> str:
    """Write the export; returns a one-line description of what was written. `dtype` None: the base model's own.
    `note` gets the line that says an output_dir's final/ was passed over for a checkpoint."""
    source = source_of(source, note)
    if is_full_checkpoint(source):
        base = full_checkpoint_base(source, base_model)
        refuse_custom_code(base, "the base model")
        dtype = dtype or base_dtype(base)
        count = export_full_checkpoint(source, output, DTYPES[dtype], base,
                                       prepare=lambda: prepare_output(output, force))
        copy_tokenizer(source, base, output)
        return f"full model ({count} tensors, {dtype}) from {source} in {output}"
    if export_kind(source) == "Hugging Face model":
        raise MeshtuneError(f"{source} is already a Hugging Face model directory (a full fine-tuning run's final/): "
                            f"load it as it is; export one of the run's checkpoint-N for an earlier step")
    adapters = read_adapters(source)
    base = Path(base_model or adapters.base_model)
    refuse_custom_code(base, "the base model")
    if merge and not (base / "config.json").is_file():
        raise MeshtuneError(f"the base model folder {base} (where the adapters were trained from) has no "
                            f"config.json; pass --base-model DIR with the original model files")
    dtype = (dtype or base_dtype(base)) if merge else dtype
    prepare_output(output, force)
    if not merge:
        write_adapter_dir(adapters, output)
        copy_tokenizer(source, base, output)
        in_full = f", {len(adapters.modules)} modules trained in full" if adapters.modules else ""
        return f"PEFT adapter ({len(adapters.pairs)} LoRA layers, r={adapters.rank}{in_full}) in {output}"
    merged = merge_into(adapters, base, output, DTYPES[dtype])
    copy_tokenizer(source, base, output)
    return f"merged model ({merged} layers changed, {dtype}) in {output}"


def write_adapter_dir(adapters: Adapters, output: Path) -> None:
    from peft import LoraConfig

    in_full = sorted({key.rsplit(".", 2)[-2] for key in adapters.modules})  # peft's modules_to_save: last names
    config = LoraConfig(r=adapters.rank, lora_alpha=adapters.alpha, lora_dropout=adapters.dropout,
                        target_modules=sorted(adapters.pairs), task_type="CAUSAL_LM", bias="none",
                        base_model_name_or_path=adapters.base_model, modules_to_save=in_full or None)
    config.save_pretrained(str(output))
    tensors = {f"{PEFT_PREFIX}{module}.lora_{part}.weight": tensor.contiguous()
               for module, (a, b) in adapters.pairs.items() for part, tensor in (("A", a), ("B", b))}
    tensors.update({f"{PEFT_PREFIX}{key}": tensor.contiguous() for key, tensor in adapters.modules.items()})
    save_file(tensors, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})


def merge_into(adapters: Adapters, base: Path, output: Path, dtype: torch.dtype) -> int:
    """W + alpha / r * B @ A (in fp32) for every adapted linear layer, and the trained weights of the modules
    trained in full in place of the base's, file by file; returns the layers changed."""
    index = base / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    pending = {f"{module}.weight": pair for module, pair in adapters.pairs.items()}
    replaced = dict(adapters.modules)
    config = json.loads((base / "config.json").read_text())
    # no head of its own in the files: it is the embedding (tied); trained apart from it (its own copy, or the
    # embedding alone), it is written and the two untied
    untie = bool(replaced) and HEAD not in stored_keys(base, files)
    head: torch.Tensor | None = replaced.pop(HEAD, None) if untie else None
    total = 0
    for n, name in enumerate(tqdm(files, desc="merging", unit="file")):
        path = base / name
        if not path.is_file():
            raise MeshtuneError(f"{path} not found: the base model folder is incomplete")
        tensors = {}
        with safe_open(str(path), framework="pt") as reader:
            for key in reader.keys():
                weight = reader.get_tensor(key)
                if key in replaced:
                    if untie and head is None and weight.shape == (config.get("vocab_size"), config.get("hidden_size")):
                        head = weight  # the embedding trained alone: the head keeps the base's
                    weight = replaced.pop(key)
                if key in pending:
                    a, b = pending.pop(key)
                    weight = weight.float() + adapters.scale * (b.float() @ a.float())
                tensors[key] = weight.to(dtype) if weight.is_floating_point() else weight
                total += tensors[key].numel() * tensors[key].itemsize
        if n == len(files) - 1 and head is not None:
            tensors[HEAD] = head.to(dtype)
            total += tensors[HEAD].numel() * tensors[HEAD].itemsize
            if weight_map is not None:
                weight_map[HEAD] = name
        save_file(tensors, str(output / name), metadata={"format": "pt"})
    if pending or replaced:
        missing = [*pending, *replaced]
        raise MeshtuneError(f"the base model in {base} has no weight for {len(missing)} trained layers (e.g. "
                            f"{missing[0]}); pass --base-model with the model the adapters were trained on")
    if weight_map is not None:  # the base's index, with the head where it was added and the exported size
        listing = json.loads(index.read_text())
        listing["metadata"] = {**listing.get("metadata", {}), "total_size": total}
        (output / index.name).write_text(json.dumps({**listing, "weight_map": weight_map}, indent=2) + "\n")
    write_model_config(base, output, dtype, untie=head is not None)
    return len(adapters.pairs) + len(adapters.modules)


def stored_keys(base: Path, files: list[str]) -> set[str]:
    keys: set[str] = set()
    for name in files:
        if (base / name).is_file():
            with safe_open(str(base / name), framework="pt") as reader:
                keys.update(reader.keys())
    return keys


def copy_tokenizer(source: Path, base: Path, output: Path) -> None:
    """The tokenizer saved with final/ (it carries the chat template trained with); for a checkpoint-N, the base's
    with the template its run trained with, so `apply_chat_template` on the export renders prompts as trained;
    for an adapter directory of another origin, the base's."""
    from meshtune.model.model_dir import load_tokenizer

    if (source / "tokenizer_config.json").is_file():
        load_tokenizer(source).save_pretrained(str(output))
        return
    tokenizer = load_tokenizer(base)
    template = trained_chat_template(source, tokenizer) if (source / MANIFEST).is_file() else None
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(output))


def trained_chat_template(checkpoint: Path, tokenizer) -> str | None:
    """The chat template a checkpoint's run trained with, as final/ saves it (None: the tokenizer's own): kept in
    its manifest; a manifest from before checkpoints kept it has the run's `template`, rendered again."""
    from meshtune.config import template_choice
    from meshtune.data.chat_template import serving_chat_template

    manifest = read_manifest(checkpoint)
    if "chat_template" in manifest:
        return manifest["chat_template"]
    return serving_chat_template(tokenizer, template_choice((manifest.get("config") or {}).get("template")))
