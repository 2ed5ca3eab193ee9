"""Installed packages that cannot run together, named before a run fails deep inside one of them."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version


def installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def release(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '0.18.0' or '0.21.2.dev0'; None where there is none."""
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found[1]), int(found[2])) if found else None


def peft_torchao_clash(peft: str | None, torchao: str | None) -> str | None:
    """What to do where peft and torchao cannot build a LoRA layer together, else None. peft before 0.19 imports
    torchao's LinearActivationQuantizedTensor in the dispatcher every LoRA layer passes through (dispatch_torchao),
    and torchao 0.18 removed that class: with both installed every LoRA run, not only Q-LoRA, dies in
    get_peft_model with an ImportError."""
    peft_release, torchao_release = release(peft), release(torchao)
    if peft_release is None or torchao_release is None or peft_release >= (0, 19) or torchao_release < (0, 18):
        return None
    return (f"peft {peft} cannot build LoRA layers beside torchao {torchao}: it imports torchao's "
            f"LinearActivationQuantizedTensor, which torchao 0.18 removed. Install peft 0.19 or later "
            f"(pip install -U peft), or torchao before 0.18")


def installed_peft_torchao_clash() -> str | None:
    return peft_torchao_clash(installed_version("peft"), installed_version("torchao"))
