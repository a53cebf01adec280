"""Byte sizes as the benchmarks read them (4K, 1M) and print them (4 KiB, 1 MiB)."""

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = UNITS.get(text[-1:], 1)
    return int(text[:-1] if text[-1:] in UNITS else text) * mult


def size_name(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"
