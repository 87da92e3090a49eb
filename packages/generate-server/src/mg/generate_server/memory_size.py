"""Memory sizes as users write them (`--kv-cache-memory 2GiB` or a fraction, 0.5).

No torch here: the command line parses it before anything heavy is imported.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(text: str) -> int | float:
    """'2GiB' / '512MiB' / '1.5GB' / '1000000' → bytes (int); '0.5' → a fraction (float)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is neither a size (2GiB, 512MiB, 1000000) nor a fraction (0.5)")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and number <= 1.0 and "." in match.group(1):
        if number <= 0.0:
            raise ValueError(f"a fraction of free memory must be > 0, got {text}")
        return number
    size = int(number * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{text!r} is no memory at all")
    return size
