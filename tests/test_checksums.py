"""One file hasher, one dataset checksum: what the nodes compare, the tokenized cache keys on and checkpoint
manifests hold."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from meshtune.checkpoint.manifest import COMPLETE, MANIFEST, verify
from meshtune.checksums import RememberedChecksums, dataset_checksum, file_checksum
from meshtune.data.formats import DatasetSpec, file_spec

RECORDS = [{"instruction": "Add.", "input": "2 and 3", "output": "5"}, {"instruction": "Hi", "output": "Hello"}]
LF_ALPACA = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
             "tools": None}


def write(path, records=RECORDS):
    path.write_text(json.dumps(records))
    return path


def test_the_file_hasher_reads_in_blocks_and_gives_hashlibs_digest(tmp_path):
    data = os.urandom(3 * 4096 + 17)  # three whole blocks and a short one
    path = tmp_path / "shard.distcp"
    path.write_bytes(data)
    expected = (len(data), hashlib.sha256(data).hexdigest())
    assert file_checksum(path, block=4096) == expected == file_checksum(path, fsync=True)
    assert file_checksum(path).sha256 == expected[1] and file_checksum(path).size == len(data)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert file_checksum(empty) == (0, hashlib.sha256(b"").hexdigest())


def test_the_dataset_checksum_covers_content_and_order(tmp_path):
    a, b = write(tmp_path / "a.json"), write(tmp_path / "b.json", RECORDS[::-1])

    def checksum(*paths):
        return dataset_checksum([DatasetSpec("data", list(paths))])

    first = checksum(a, b)
    assert first == checksum(a, b) != checksum(b, a)
    write(b, RECORDS * 2)
    assert checksum(a, b) != first
    # two datasets are not one dataset of the same files
    assert dataset_checksum([file_spec(a), file_spec(b)]) != checksum(a, b)


def test_the_dataset_checksum_changes_with_how_records_are_read_and_with_nothing_else(tmp_path):
    data = write(tmp_path / "train.json")
    registry = tmp_path / "dataset_info.json"
    registered = DatasetSpec("train", [data], "alpaca", LF_ALPACA, None, registry)
    first = dataset_checksum([registered])
    # what changes the conversations, so the tokens: format, columns, tags
    assert dataset_checksum([DatasetSpec("train", [data], "sharegpt", LF_ALPACA, None, registry)]) != first
    no_query = {**LF_ALPACA, "query": None}
    assert dataset_checksum([DatasetSpec("train", [data], "alpaca", no_query, None, registry)]) != first
    tagged = {"role_tag": "from", "content_tag": "value"}
    assert dataset_checksum([DatasetSpec("train", [data], "alpaca", LF_ALPACA, tagged, registry)]) != first
    assert dataset_checksum([file_spec(data)]) != first  # auto-detected, default columns
    # what does not: the entry's name, the dataset_info.json it came from, where the same bytes lie
    copy = shutil.copy(data, tmp_path / "elsewhere.json")
    same = [DatasetSpec("renamed", [data], "alpaca", LF_ALPACA, None, registry),
            DatasetSpec("train", [data], "alpaca", dict(LF_ALPACA), None, tmp_path / "other" / "dataset_info.json"),
            DatasetSpec("train", [copy], "alpaca", LF_ALPACA, None, registry)]
    assert {dataset_checksum([spec]) for spec in same} == {first}


def test_remembered_checksums_hash_a_file_again_only_once_it_changed(tmp_path, monkeypatch):
    import meshtune.checksums as checksums

    path = write(tmp_path / "model.safetensors")
    store = tmp_path / "cache" / "file-checksums.json"
    hashed = []
    real = checksums.file_sha256
    monkeypatch.setattr(checksums, "file_sha256", lambda p: hashed.append(p) or real(p))
    remembered = RememberedChecksums(store)
    assert remembered.sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    remembered.save()
    again = RememberedChecksums(store)  # another launch
    assert again.sha256(path) == remembered.sha256(path) and len(hashed) == 1
    write(path, RECORDS * 3)  # another size: hashed again
    assert again.sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest() and len(hashed) == 2
    assert not list(store.parent.glob("*.tmp"))


def test_a_manifest_written_before_still_verifies(tmp_path):
    """The manifest's entries are {"size", "sha256"} with sha256 as hex, as they always were."""
    final = tmp_path / "final"
    final.mkdir()
    files = {"adapter_model.safetensors": os.urandom(5000), "adapter_config.json": b'{"r": 8}'}
    listed = {}
    for name, data in files.items():
        (final / name).write_bytes(data)
        listed[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (final / MANIFEST).write_text(json.dumps({"kind": "final", "step": 4, "files": listed}, indent=1,
                                             sort_keys=True) + "\n")
    (final / COMPLETE).write_text("step 4\n")
    assert verify(final) == []
    (final / "adapter_config.json").write_bytes(b'{"r": 9}')
    assert verify(final) == ["checksum mismatch in adapter_config.json"]
