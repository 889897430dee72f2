"""Byte counts written for people: ``format_size(64 << 20) == "64.0 MiB"``.

Messages and logs give sizes in binary units with three significant digits
(``"3.91 MiB"``, ``"64.0 MiB"``, ``"800 GiB"``, ``"1.00 PiB"``), and counts
below 1 KiB as bytes (``"512 bytes"``). Parsing sizes is
:mod:`kvtier.config`'s.
"""

from __future__ import annotations

__all__ = ["format_size"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, three significant digits.

    Examples
    --------
    >>> format_size(1125899906834432)
    '1.00 PiB'
    >>> format_size(4096)
    '4.00 KiB'
    >>> format_size(-3 << 30)
    '-3.00 GiB'
    >>> format_size(100)
    '100 bytes'
    """
    if n < 0:
        return f"-{format_size(-n)}"
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    unit = ""
    for unit in _UNITS:
        value /= 1024
        if round(value, 2) < 1024 or unit == _UNITS[-1]:
            break
    if round(value, 2) < 10:
        return f"{value:.2f} {unit}"
    if round(value, 1) < 100:
        return f"{value:.1f} {unit}"
    return f"{value:.0f} {unit}"
