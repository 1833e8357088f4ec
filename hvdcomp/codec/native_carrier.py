"""The native kernel that turns a reduced float carrier's words into their exact int64 sums, in place
(``hvdcomp.codec.carrier.unwrap``), through ctypes.

One pass where torch takes three (scale, round, convert into a new int64 tensor): each float64 sum times the
multiplier (1 after a Sum, W after an Average) rounded half to even, its int64 written over it, and a check that
every sum lies in ``[0, 2**51)``, where sums of carrier words lie (docs/benchmarks.md#the-float-carrier-in-place).
Use it where ``native.usable(words, torch.float64)`` says; the wrapper checks the sizes it hands the kernel
(``native``'s docstring).
"""

from __future__ import annotations

import torch

from .native import _checked, _in_parallel, _Library

MAX_MULTIPLIER = 2**32  # the kernel's bound (a worker count)


def carrier_sums(words: torch.Tensor, multiplier: int) -> bool:
    """``words`` (contiguous float64 ``[n]``, CPU) <- in place, the bits of the int64 nearest ``words * multiplier``
    (half to even; ``multiplier`` an int in ``[1, 2**32]``). Returns False when some result lies outside ``[0,
    2**51)`` (each such one written as 0), else True."""
    numel = _checked("the carrier's words", words, torch.float64).numel()
    if not (isinstance(multiplier, int) and 1 <= multiplier <= MAX_MULTIPLIER):
        raise ValueError(f"the carrier's sums are scaled by a worker count in [1, 2**32], not {multiplier!r}")
    lib = _Library.handle

    def run(first: int, last: int) -> torch.Tensor:  # this range's flag: some sum out of range
        flag = torch.zeros(1, dtype=torch.uint8)
        lib.hvdcomp_carrier_sums(words.data_ptr(), numel, float(multiplier), first, min(last, numel), flag.data_ptr())
        return flag

    flags = _in_parallel(run, -(-numel // 4) * 4, 4)  # split at multiples of 4 words; the last range ends at numel
    return not any(bool(flag) for flag in flags)
