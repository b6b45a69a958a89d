"""Numbers as the plan table prints them: counts (1.23B), bytes (71.9 GiB) and FLOPs (19.1 GFLOP), in the unit
that keeps three significant digits.

    bytes_text(3 * 2**30)   # '3.00 GiB'
"""
from __future__ import annotations

GiB = 2**30


def count_text(n: float) -> str:
    """950, 1.20K, 3.25M, 1.23B, 1.00T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


def _scaled(n: float, units: tuple) -> str:
    """n in the largest of `units` ((name, scale), ascending) that keeps it at 1 or more, 3 significant digits."""
    name, scale = units[0]
    for unit in units:
        if abs(n) >= unit[1]:
            name, scale = unit
    v = n / scale
    return f"{v:,.0f} {name}" if scale == 1 or abs(v) >= 100 else f"{v:,.{2 if abs(v) < 10 else 1}f} {name}"


def bytes_text(n: float) -> str:
    """0 B, 512 B, 3.25 KiB, 12.4 MiB, 71.9 GiB."""
    return _scaled(n, (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", GiB), ("TiB", 2**40)))


def flop_text(n: float) -> str:
    """1.20 MFLOP, 19.1 GFLOP, ..."""
    return _scaled(n, (("FLOP", 1), ("KFLOP", 1e3), ("MFLOP", 1e6), ("GFLOP", 1e9), ("TFLOP", 1e12)))
