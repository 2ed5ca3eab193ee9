"""The package installs on Python 3.10 (requires-python): no standard-library API or syntax of a later Python in
meshtune's code, its tests or the bench, as vermin (a dev dependency) reads them. Annotations are checked as if
evaluated: pydantic evaluates the config's at run time."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def oldest_python() -> str:
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'requires-python = ">=(\d+\.\d+)"', text).group(1)


@pytest.mark.slow
def test_no_api_newer_than_the_oldest_python_the_package_allows():
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    assert vermin, "vermin is missing: pip install -e '.[dev]'"
    target = oldest_python()
    result = subprocess.run([vermin, f"--target={target}-", "--no-tips", "--violations", "--eval-annotations",
                             "--no-parse-comments", "src", "tests", "bench"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"needs a Python newer than {target}:\n{result.stdout[-4000:]}{result.stderr}"


def test_file_checksums_are_streamed_in_blocks(tmp_path):
    from meshtune.checksums import file_checksum

    data = bytes(range(256)) * 5000  # 1.28 MB: several blocks of 300 kB, the last one short
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert file_checksum(path, block=300_000) == file_checksum(path) == (len(data), hashlib.sha256(data).hexdigest())
