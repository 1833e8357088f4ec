"""Argument checks shared by every layer: one style, one message shape (``"<name> must be ..., got <value>"``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

MIN_BITS, MAX_BITS = 1, 16  # a max-norm resolution's bits per sign
LISTED_GROUPS = 64  # scale groups checked from a list of ints; more are reduced in torch



def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_real(name: str, value: object, low: float = 0.0, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = True) -> float:
    """``value`` as a ``float`` if it is a finite real (not a bool) in the interval; else ``ValueError``.

    The interval is ``[low, high)`` by default; ``low_open`` / ``high_open`` choose each end.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; else ``ValueError``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def group_total(groups: torch.Tensor, numel: int | None) -> int:
    """The elements that ``groups`` (1-D, int64 lengths) cover; ``ValueError`` unless the lengths are non-negative and,
    with ``numel`` given, split ``numel`` elements (no groups split any number). Up to ``LISTED_GROUPS`` lengths are
    read as ints in one call into torch (a codec call's checks are many small calls:
    docs/benchmarks.md#the-stock-adapter), more by two reductions."""
    if groups.dim() != 1:
        raise ValueError(f"scale groups must be a vector of lengths, got shape {tuple(groups.shape)}")
    if groups.numel() <= LISTED_GROUPS:
        lengths = groups.tolist()
        total, lowest = sum(lengths), min(lengths, default=0)
    else:
        total, lowest = int(groups.sum()), int(groups.min())
    if lowest < 0 or (numel is not None and groups.numel() and total != numel):
        what = "their elements: a length is negative" if numel is None else f"{numel} elements"
        raise ValueError(f"scale groups {groups.tolist()[:8]}... do not split {what}")
    return total


def check_groups(groups: torch.Tensor, numel: int) -> None:
    """Raise ``ValueError`` unless ``groups`` (int64 lengths, on the CPU) split ``numel`` elements."""
    group_total(groups, numel)


def check_stats(scale_stats: torch.Tensor, groups: torch.Tensor, numel: int) -> None:
    """Raise ``ValueError`` unless ``scale_stats`` has a scale per group and the nonfinite flag, the groups
    splitting ``numel`` elements."""
    check_groups(groups, numel)
    if scale_stats.shape != (groups.numel() + 1,):
        raise ValueError(f"scale_stats of shape {tuple(scale_stats.shape)} do not fit {groups.numel()} scale groups "
                         f"(want [{groups.numel() + 1}]: a scale per group, then the nonfinite flag)")


def check_bits(bits: Sequence[int]) -> tuple[int, ...]:
    """Max-norm resolutions as a tuple: each an integer in ``[MIN_BITS, MAX_BITS]``, strictly increasing."""
    bits = tuple(bits)
    if not bits:
        raise ValueError("bits must name at least one resolution")
    for b in bits:
        if check_int("bits", b, MIN_BITS) > MAX_BITS:
            raise ValueError(f"bits must be integers in [{MIN_BITS}, {MAX_BITS}], got {b!r}")
    if any(lo >= hi for lo, hi in zip(bits, bits[1:])):
        raise ValueError(f"multi-scale bits must be strictly increasing, got {bits}")
    return bits
