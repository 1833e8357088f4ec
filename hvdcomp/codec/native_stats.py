"""The native kernel of QSGD's local statistics (``hvdcomp.codec.quantize.MaxNormQuantizer.local_stats``), through
ctypes.

One read of the values for every scale group's largest finite magnitude and the NaN/Inf flag, where torch takes an
``aminmax`` per group (two reductions) and, for many short groups or a non-finite value, magnitudes and a segmented
reduction: the exchanges whose scale is agreed before the payload (``scale="exact"``, the two-stage exchange, a
bucket's first exchange) read it once per bucket (docs/benchmarks.md#the-local-statistics). Use it where
``native.usable(x)`` says; the wrapper checks the sizes it hands the kernel (``native``'s docstring).
"""

from __future__ import annotations

import torch

from .native import _checked, _groups, _in_parallel, _Library


def local_stats(x: torch.Tensor, groups: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[len(groups) + 1]``: the largest finite ``|x|`` of each scale group (int64 lengths ``groups``
    splitting flat float32 ``x``, contiguous, CPU; 0.0 for a group without one), then 1.0 if ``x`` holds NaN or
    Inf, else 0.0, or, given ``finite`` (0-d bool), 1.0 where it is False: ``MaxNormQuantizer.local_stats`` bit for
    bit."""
    numel = _checked("x", x, torch.float32).numel()
    ends, _, _ = _groups(groups, torch.zeros(groups.shape), numel)  # lengths only: no factors
    stats = torch.zeros(ends.numel() + 1, dtype=torch.float32)

    def run(first: int, last: int) -> torch.Tensor:  # this range's statistics (all of them: stats itself)
        part = stats if last - first == numel else torch.zeros_like(stats)
        _Library.handle.hvdcomp_local_stats(x.data_ptr(), numel, ends.data_ptr(), ends.numel(), first, last,
                                            part.data_ptr())
        return part

    partials = _in_parallel(run, numel, 1)
    if len(partials) > 1:
        torch.amax(torch.stack(partials), dim=0, out=stats)
    if finite is not None:
        stats[-1] = (~finite).float()
    return stats
