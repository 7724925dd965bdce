"""Argument types of ``python -m fsdp2.plan``: sizes with units, booleans, counts (``_cli.py`` uses them)."""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable

from ..memory._tracker import format_bytes

__all__ = ["parse_bytes", "SIZES", "AC_CHOICES"]

# GPU makers' "GB" are binary: an "80 GB" GPU holds 80 GiB (an "A100 40GB" reports 42,405,855,232
# bytes = 39.49 GiB to CUDA). So GB reads as GiB here, and the output says so.
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 2**10, "mb": 2**20, "gb": 2**30,
          "tb": 2**40}
SIZES = ("sizes take a unit: GiB/MiB/TiB, or GB/MB/TB read the same (binary, as GPU makers count: "
         "an '80 GB' GPU holds 80 GiB, of which CUDA reports a little less), or B for bytes")
AC_CHOICES = {"full": True, "none": False, "true": True, "false": False, "on": True, "off": False}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB' (the same: binary), '512MiB', '85899345920B' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; {SIZES}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class _Size(int):
    """A size in bytes that remembers how it was written (to say how a "GB" was read)."""

    text: str

    def note(self, flag: str) -> str | None:
        unit = re.sub(r"[0-9.e\s]", "", self.text).lower()
        if unit in ("kb", "mb", "gb", "tb"):
            return (f"{flag} {self.text} read as {format_bytes(self)} ({unit.upper()} as GPU makers count, binary: "
                    f"write {unit[0].upper()}iB to say so, or B for bytes)")
        return None


def _size(text: str) -> _Size:
    size = _Size(parse_bytes(text))
    size.text = text
    return size


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _reshard(text: str) -> bool | int:
    """``--reshard-after-forward``: true, false, or an int N >= 2 (reshard to N ranks: one node's GPUs)."""
    if text.strip() in ("0", "1"):  # true/false before ints were taken: which was meant is unclear
        raise argparse.ArgumentTypeError(f"{text!r} is ambiguous: write true or false (an int N >= 2 reshards "
                                         "the blocks to groups of N ranks after forward, e.g. the GPUs of a node)")
    try:
        return _bool(text)
    except argparse.ArgumentTypeError:
        pass
    return _number(text, int, lambda v: v >= 2, "true, false or an int N >= 2 (ranks to reshard to after forward)")


def _ac(text: str) -> bool:
    if text.lower() == "selective":
        raise argparse.ArgumentTypeError("selective (per-op) activation checkpointing is not modeled; use full or none")
    if text.lower() not in AC_CHOICES:
        raise argparse.ArgumentTypeError(f"expected full or none, got {text!r}")
    return AC_CHOICES[text.lower()]


def _number(text: str, convert: type, ok: Callable[[Any], bool], expected: str) -> Any:
    """``text`` as a ``convert`` that ``ok`` accepts, else argparse's error saying what was expected."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _count(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _fraction(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < 1, "a fraction in [0, 1)")
