"""One form for sizes in every message."""

from __future__ import annotations

import pytest

from meshtune.units import byte_size


@pytest.mark.parametrize("size, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"),
    (1100 * 1024, "1.1 MiB"), (16 * 2**20, "16 MiB"), (256 * 2**20, "256 MiB"), (70.94 * 2**30, "70.9 GiB"),
    (3 * 2**40, "3 TiB"), (5000 * 2**40, "5000 TiB"),
])
def test_sizes_in_the_largest_unit_they_reach(size, text):
    assert byte_size(size) == text
