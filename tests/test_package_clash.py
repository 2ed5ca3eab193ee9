"""peft before 0.19 beside torchao 0.18 or later cannot build a LoRA layer (peft imports a class torchao removed):
the run refuses by name before peft's ImportError, and the doctor marks the node."""

from __future__ import annotations

import pytest

from meshtune.config import build_config
from meshtune.errors import ConfigError
from meshtune.model.loading import load_model
from meshtune.package_clash import peft_torchao_clash, release


@pytest.mark.parametrize("peft, torchao, clash", [
    ("0.18.0", "0.18.0", True), ("0.17.1", "0.19.2", True), ("0.18.0", "0.17.0", False),
    ("0.19.0", "0.18.0", False), ("0.21.2", "0.18.0", False), ("0.18.0", None, False),
    ("0.18.0", "not installed", False), (None, "0.18.0", False)])
def test_peft_before_0_19_clashes_with_torchao_0_18_and_later_only(peft, torchao, clash):
    found = peft_torchao_clash(peft, torchao)
    assert bool(found) is clash
    if clash:
        assert f"peft {peft} cannot build LoRA layers beside torchao {torchao}" in found
        assert "pip install -U peft" in found


def test_release_reads_major_and_minor():
    assert release("0.21.2.dev0") == (0, 21) and release("1.0") == (1, 0) and release("not installed") is None


def test_add_lora_refuses_the_clash_by_name_before_peft_fails(tiny_model_dir, monkeypatch):
    from meshtune.model import lora

    versions = {"peft": "0.18.0", "torchao": "0.18.0"}
    monkeypatch.setattr("meshtune.package_clash.installed_version", versions.get)
    cfg = build_config(dict(model_name_or_path=str(tiny_model_dir), dataset="d.json", lora_rank=4))
    with pytest.raises(ConfigError, match=r"finetuning_type: lora: peft 0.18.0 cannot build LoRA layers beside "
                                          r"torchao 0.18.0"):
        lora.add_lora(load_model(tiny_model_dir), cfg)
    versions["peft"] = "0.21.0"
    assert lora.add_lora(load_model(tiny_model_dir), cfg) is not None


def test_the_doctor_fails_a_node_whose_peft_and_torchao_clash():
    from meshtune.doctor.checks import FAIL, OK, software_row

    def node(rank, peft):
        return {"node_rank": rank, "host": f"h{rank}",
                "software": {"torch": "2.13", "meshtune": "1.0", "peft": peft, "torchao": "0.18.0"}}

    facts = [node(0, "0.21.0"), node(1, "0.21.0")]
    row = software_row(facts, facts[0])
    assert [row.cells[p][0] for p in range(2)] == [OK, OK]
    facts = [node(0, "0.18.0"), node(1, "0.18.0")]
    row = software_row(facts, facts[0])
    assert row.cells[0] == (FAIL, "peft 0.18.0, torchao 0.18.0") and row.cells[1][0] == FAIL
    assert any("Install peft 0.19 or later" in fix for fix in row.fixes)
