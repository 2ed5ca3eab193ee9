"""ruff (a dev dependency) over src/, tests/ and bench/: pyflakes' and pycodestyle's checks, lines at most 120
characters ([tool.ruff] in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.slow
def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: pip install -e '.[dev]'"
    result = subprocess.run([ruff, "check", "--no-cache", "src", "tests", "bench"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"{result.stdout[-4000:]}{result.stderr}"
