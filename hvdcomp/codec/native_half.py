"""The native kernel of the 16-bit exchange's mean (``hvdcomp.codec.half.mean_from_half_sums``), through ctypes.

float16 or bfloat16 sums widened to float32 and divided by the worker count in one pass, bit for bit what the eager
reference computes (``tests/test_native_half.py``), at a quarter of the compiled kernel's cost per call and 15 % less
per element (docs/benchmarks.md#the-16-bit-mean). Use it where ``native.usable`` says; the wrapper checks the sizes it
hands the kernel (``native``'s docstring).
"""

from __future__ import annotations

import torch

from .native import _checked, _in_parallel, _Library

KINDS = {torch.float16: 0, torch.bfloat16: 1}  # native_kernels.cpp's kFloat16, kBFloat16


def half_mean(sums: torch.Tensor, world_size: int, out: torch.Tensor, check_finite: bool) -> bool:
    """``out`` (contiguous float32 ``[n]``, CPU) <- ``sums`` (contiguous float16 or bfloat16 ``[n]``, CPU) /
    ``world_size`` at float32. Returns False when ``check_finite`` and some mean is NaN or ±Inf, else True."""
    numel = _checked("the mean", out, torch.float32).numel()
    kind = KINDS.get(sums.dtype)
    if kind is None or sums.shape != out.shape:
        raise ValueError(f"the kernel takes float16 or bfloat16 sums of {numel} elements, not {sums.dtype} "
                         f"{tuple(sums.shape)}")
    _checked("the sums", sums, sums.dtype)
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"the mean is over at least one worker, not {world_size!r}")
    lib = _Library.handle

    def run(first: int, last: int) -> torch.Tensor | None:  # this range's flag: some mean NaN or infinite
        flag = torch.zeros(1, dtype=torch.uint8) if check_finite else None
        lib.hvdcomp_half_mean(sums.data_ptr(), numel, kind, float(world_size), first, min(last, numel),
                              out.data_ptr(), None if flag is None else flag.data_ptr())
        return flag

    flags = _in_parallel(run, -(-numel // 8) * 8, 8)  # split at multiples of 8 values; the last range ends at numel
    return not check_finite or not any(bool(flag) for flag in flags)
