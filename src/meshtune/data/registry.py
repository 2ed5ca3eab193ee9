"""Dataset entries of the config → `DatasetSpec`s: a file or folder given by path, or a name in LLaMA-Factory's
registry, `<dataset_dir>/dataset_info.json`, read with the meaning LLaMA-Factory gives it (file_name relative to
dataset_dir, formatting, columns, tags).

What LLaMA-Factory would download, or would train in a stage meshtune does not have, is refused here, before
any process starts, with what to do instead.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import replace
from pathlib import Path

from meshtune.config import TEXT_FORMAT, UNPAIRED_FORMAT
from meshtune.data.formats import EXTENSIONS, LF_COLUMNS, LF_TAGS, DatasetSpec
from meshtune.errors import DataError

TEXT_EXTENSIONS = (*EXTENSIONS, ".txt")  # raw text (stage: pt) also reads plain text files, a document a line
TEXT_COLUMN = "text"  # the field of a raw-text record given by path, as in LLaMA-Factory's c4_demo

INFO_FILE = "dataset_info.json"
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
FORMATTINGS = ("alpaca", "sharegpt")
# Every column and tag LLaMA-Factory reads; any other name in `columns` / `tags` is a typo that would go unused.
COLUMN_NAMES = ("prompt", "query", "response", "history", "messages", "system", "tools", "images", "videos",
                "audios", "chosen", "rejected", "kto_tag")
MEDIA_COLUMNS = ("images", "videos", "audios")
PAIR_COLUMNS = ("chosen", "rejected")  # a ranking: true entry's responses (stage: dpo, data/pairs.py)


def resolve(entries: list[str], dataset_dir: str | Path, fmt: str | None = None, key: str = "dataset"
            ) -> list[DatasetSpec]:
    """One spec per entry, in order. An entry that exists as a file or folder is read with `fmt` (dataset_format;
    None: detected per file; `text`: raw text, for stage: pt); any other is a name in
    `<dataset_dir>/dataset_info.json`. Errors name the config `key` the entries come from (dataset, eval_dataset)."""
    dataset_dir = Path(dataset_dir)
    named = [entry for entry in entries if not Path(entry).exists()]
    info = _read_info(dataset_dir, named[0], key) if named else {}
    if fmt == TEXT_FORMAT:
        return [_text_path_spec(entry) if Path(entry).exists() else _text_named_spec(entry, info, dataset_dir, key)
                for entry in entries]
    if fmt == UNPAIRED_FORMAT:  # stage: kto: each file's format detected, the tag read beside the conversation
        return [replace(_path_spec(entry, None), unpaired=True) if Path(entry).exists()
                else _named_spec(entry, info, dataset_dir, key, unpaired=True) for entry in entries]
    return [_path_spec(entry, fmt) if Path(entry).exists() else _named_spec(entry, info, dataset_dir, key)
            for entry in entries]


def resolve_all(cfg) -> list[DatasetSpec]:
    """The specs of a config's training and held-out data (`dataset`, then `eval_dataset`), each error naming its
    key."""
    return (resolve(cfg.dataset, cfg.dataset_dir, cfg.named_format)
            + resolve(cfg.eval_dataset or [], cfg.dataset_dir, cfg.named_format, "eval_dataset"))


def _path_spec(entry: str, fmt: str | None, extensions: tuple[str, ...] = EXTENSIONS) -> DatasetSpec:
    path = Path(entry)
    files = _folder_files(path, extensions) if path.is_dir() else [path]
    for file in files:
        if file.suffix.lower() not in extensions:
            raise DataError(f"{file}: unsupported file type '{file.suffix}'; use {' or '.join(extensions)}")
    return DatasetSpec(entry, files, fmt)


def _text_path_spec(entry: str) -> DatasetSpec:
    """Raw text given by path: its records' `text` field, or a .txt file's lines."""
    spec = _path_spec(entry, TEXT_FORMAT, TEXT_EXTENSIONS)
    return DatasetSpec(spec.name, spec.files, TEXT_FORMAT, {"prompt": TEXT_COLUMN})


def _text_named_spec(name: str, info: dict, dataset_dir: Path, key: str) -> DatasetSpec:
    """A registry entry read as LLaMA-Factory's pre-training reads it: each record's prompt column is one document
    (c4_demo: columns {prompt: text})."""
    entry = _lookup(name, info, dataset_dir, key)
    where = _where(name, dataset_dir, key)
    _refuse_unsupported(entry, where, dataset_dir)
    if entry.get("formatting", "alpaca") != "alpaca":
        raise DataError(f"{where} has formatting: {entry['formatting']}: conversations; stage: pt reads raw text, "
                        f"one document a record in its prompt column (e.g. columns: {{\"prompt\": \"text\"}})")
    columns = _names(entry, "columns", COLUMN_NAMES, where)
    column = (columns or LF_COLUMNS["alpaca"]).get("prompt")
    if not column:
        raise DataError(f"{where}: its columns leave out 'prompt', the column stage: pt reads each document from; "
                        f"add it (e.g. columns: {{\"prompt\": \"text\"}})")
    return DatasetSpec(name, _entry_files(entry, where, dataset_dir, TEXT_EXTENSIONS), TEXT_FORMAT,
                       {"prompt": column}, registry=dataset_dir / INFO_FILE)


def _folder_files(folder: Path, extensions: tuple[str, ...] = EXTENSIONS) -> list[Path]:
    """Every file of the folder, by name so that all nodes read one order; as in LLaMA-Factory, a folder is read
    whole, so anything but a data file in it is an error rather than silently left out."""
    files = sorted(folder.iterdir())
    others = [p.name for p in files if not (p.is_file() and p.suffix.lower() in extensions)]
    if others:
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise DataError(f"{folder}: a dataset folder is read whole, and '{others[0]}'{more} in it is not a "
                        f"{' or '.join(extensions)} file; move it out of the folder")
    if not files:
        raise DataError(f"{folder}: the dataset folder is empty; put {' or '.join(extensions)} files in it")
    return files


def _read_info(dataset_dir: Path, entry: str, key: str) -> dict:
    path = dataset_dir / INFO_FILE
    if not path.is_file():
        raise DataError(f"{key} '{entry}': no file or folder of that name in {Path.cwd()}, and {path} does not "
                        f"exist to look the name up in; give the path of a {' or '.join(EXTENSIONS)} file or "
                        f"folder, or set dataset_dir to the folder that holds LLaMA-Factory's {INFO_FILE}")
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}; fix the file "
                        f"(a JSON object of dataset names)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot be read ({e}); fix its permissions or re-save it as UTF-8") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected a JSON object of dataset names at the top level, found "
                        f"{type(info).__name__}; write it as LLaMA-Factory does: {{\"name\": {{\"file_name\": ...}}}}")
    return info


def _named_spec(name: str, info: dict, dataset_dir: Path, key: str, unpaired: bool = False) -> DatasetSpec:
    """An entry read as LLaMA-Factory's parser and loader read it; subset and folder name parts of a hub dataset,
    which LLaMA-Factory ignores for a local file, and so does this. `unpaired` (stage: kto): the entry maps a
    kto_tag column, kept in the spec's columns."""
    entry = _lookup(name, info, dataset_dir, key)
    where = _where(name, dataset_dir, key)
    _refuse_unsupported(entry, where, dataset_dir)
    fmt = entry.get("formatting", "alpaca")
    columns = _names(entry, "columns", COLUMN_NAMES, where)
    if columns is None:
        columns = dict(LF_COLUMNS[fmt])
    _refuse_columns(columns, where, unpaired)
    ranking = bool(entry.get("ranking"))
    if ranking and unpaired:
        raise DataError(f"{where} is ranking: true, preference pairs (a chosen and a rejected response): train it "
                        f"with stage: dpo; stage: kto reads single responses with a kto_tag")
    tag = columns.get("kto_tag")
    kept = (*LF_COLUMNS[fmt], *(PAIR_COLUMNS if ranking else ()))
    columns = {key: columns.get(key) for key in kept}  # left out of `columns`: None, as in LLaMA-Factory
    if unpaired:
        if not tag:
            raise DataError(f"{where} maps no kto_tag column: stage: kto needs each record to say whether its "
                            f"response is desirable; add columns: {{\"kto_tag\": \"label\"}} (the record's key)")
        columns["kto_tag"] = tag
    needed = ["messages" if fmt == "sharegpt" else "prompt" if ranking else "response"]
    needed += list(PAIR_COLUMNS) if ranking else []
    for column in needed:
        if not columns[column]:
            raise DataError(f"{where}: its columns leave out '{column}', which {fmt}"
                            f"{' with ranking: true' if ranking else ''} needs to find the "
                            f"{'pair' if ranking else 'conversation'} (LLaMA-Factory sets every column an entry's "
                            f"columns leave out to none); add it")
    tags = None
    if fmt == "sharegpt":
        given = _names(entry, "tags", tuple(LF_TAGS), where)
        tags = dict(LF_TAGS) if given is None else {key: given.get(key) for key in LF_TAGS}
        missing = [key for key in ("role_tag", "content_tag") if not tags[key]]
        if missing:
            raise DataError(f"{where}: its tags leave out {' and '.join(missing)}, which sharegpt needs to read a "
                            f"turn (LLaMA-Factory sets every tag an entry's tags leave out to none); add them")
    return DatasetSpec(name, _entry_files(entry, where, dataset_dir), fmt, columns, tags, dataset_dir / INFO_FILE,
                       ranking=ranking, unpaired=unpaired)


def _where(name: str, dataset_dir: Path, key: str) -> str:
    return f"{dataset_dir / INFO_FILE}: dataset '{name}'" + ("" if key == "dataset" else f" ({key})")


def _lookup(name: str, info: dict, dataset_dir: Path, key: str) -> dict:
    """The registry's entry `name`, an object."""
    info_path = dataset_dir / INFO_FILE
    if name not in info:
        close = difflib.get_close_matches(name, list(info), n=5) or difflib.get_close_matches(Path(name).stem,
                                                                                               list(info), n=5)
        hint = f"close names: {', '.join(close)}" if close else f"none of its {len(info)} names is close"
        raise DataError(f"{key} '{name}': no file or folder of that name in {Path.cwd()}, and no entry '{name}' "
                        f"in {info_path} ({hint}); give an existing {' or '.join(EXTENSIONS)} path or a name "
                        f"that file defines")
    entry = info[name]
    if not isinstance(entry, dict):
        raise DataError(f"{_where(name, dataset_dir, key)} must be an object with file_name (and formatting, "
                        f"columns, tags), found {type(entry).__name__}")
    return entry


def _refuse_unsupported(entry: dict, where: str, dataset_dir: Path) -> None:
    """What LLaMA-Factory would fetch, sample at random or train in another stage."""
    if "file_name" not in entry:
        remote = [f"{key}: {entry[key]}" for key in REMOTE_KEYS if key in entry]
        if remote:
            raise DataError(f"{where} is not a local file ({', '.join(remote)}); meshtune downloads nothing and runs "
                            f"no loading scripts: download the data, put it under dataset_dir ({dataset_dir}) and "
                            f"give the entry a file_name, or pass the file path")
        raise DataError(f"{where} has no file_name; give it the data file's name relative to dataset_dir "
                        f"({dataset_dir})")
    fmt = entry.get("formatting", "alpaca")
    if fmt not in FORMATTINGS:
        raise DataError(f"{where} has formatting: {json.dumps(fmt)}; meshtune reads {' or '.join(FORMATTINGS)} "
                        f"entries (role/content messages read as sharegpt with tags role_tag: role, content_tag: "
                        f"content, user_tag: user, assistant_tag: assistant, system_tag: system)")
    if entry.get("num_samples") is not None:
        raise DataError(f"{where} has num_samples: {entry['num_samples']}: LLaMA-Factory draws that many records at "
                        f"random (repeating records when the file holds fewer) from numpy's global random state, a "
                        f"draw that cannot be reproduced; remove it and use max_samples (the first N records of each "
                        f"dataset), or cut the file to the records wanted")
    split = entry.get("split", "train")
    if split != "train":
        raise DataError(f"{where} has split: {json.dumps(split)}, but a local file has one split, train (all its "
                        f"records), and LLaMA-Factory's loader accepts only that; remove split (for the first N "
                        f"records use max_samples, for another part put it in its own file)")


def _names(entry: dict, key: str, allowed: tuple[str, ...], where: str) -> dict | None:
    """The entry's `columns` or `tags` object, checked; None when it has none."""
    if key not in entry:
        return None
    value = entry[key]
    if not isinstance(value, dict):
        raise DataError(f"{where}: {key} must be an object (e.g. {{\"{allowed[0]}\": \"...\"}}), found "
                        f"{type(value).__name__}")
    unknown = [name for name in value if name not in allowed]
    if unknown:
        raise DataError(f"{where}: {key} has {', '.join(repr(n) for n in unknown)}, which LLaMA-Factory does not "
                        f"read; use {', '.join(allowed)}")
    for name, record_key in value.items():
        if record_key is not None and not isinstance(record_key, str):
            raise DataError(f"{where}: {key}.{name} must be a string (a key of the records), found "
                            f"{json.dumps(record_key)}")
    return value


def _refuse_columns(columns: dict, where: str, unpaired: bool = False) -> None:
    media = [f"{key}: {columns[key]}" for key in MEDIA_COLUMNS if columns.get(key)]
    if media:
        raise DataError(f"{where} maps media columns ({', '.join(media)}); meshtune trains on text only: use a "
                        f"dataset without images, videos or audios")
    if columns.get("kto_tag") and not unpaired:
        raise DataError(f"{where} maps kto_tag ({columns['kto_tag']}): data for KTO (answers marked desirable or "
                        f"not); train it with stage: kto, or use conversations without the tag")


def _entry_files(entry: dict, where: str, dataset_dir: Path, extensions: tuple[str, ...] = EXTENSIONS) -> list[Path]:
    """file_name relative to dataset_dir, a file or a folder of files, as LLaMA-Factory's loader joins it."""
    file_name = entry["file_name"]
    if not isinstance(file_name, str) or not file_name:
        raise DataError(f"{where}: file_name must be a file or folder name, found {json.dumps(file_name)}")
    path = dataset_dir / file_name
    if path.is_dir():
        return _folder_files(path, extensions)
    if not path.is_file():
        raise DataError(f"{where}: {path} not found (file_name {file_name!r} is relative to dataset_dir "
                        f"{dataset_dir}); put the data there or fix file_name")
    if path.suffix.lower() not in extensions:
        raise DataError(f"{where}: {path} is a '{path.suffix}' file; meshtune reads {' or '.join(extensions)} "
                        f"(not LLaMA-Factory's csv, parquet, arrow{'' if '.txt' in extensions else ' or txt'} "
                        f"files): convert it")
    return [path]
