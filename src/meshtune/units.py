"""Sizes as people read them, in one form for every message: logs, errors and the doctor's table."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_size(size: float) -> str:
    """`size` bytes in the largest binary unit it reaches, to one decimal, a whole number without it: 512 B,
    1 KiB, 1.1 MiB, 16 MiB, 70.9 GiB."""
    value, unit = float(size), UNITS[0]
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            break
        value /= 1024
    text = f"{value:.1f}".removesuffix(".0") if unit != "B" else f"{value:.0f}"
    return f"{text} {unit}"
