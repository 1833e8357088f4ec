"""The native kernel that finds a scale-ahead exchange's clipped elements and their excess
(``hvdcomp.codec.agreed.AgreedScales.clipped``), through ctypes.

One read of the scale groups whose values rose above their agreed scale, where torch builds a gradient-sized
limit, the values' magnitudes and a mask over the whole bucket: with gradients that change from step to step,
some group of a bucket clips at almost every exchange (docs/benchmarks.md#the-clipped-excess). Use it where
``native.usable(values)`` says; the wrapper checks the sizes it hands the kernel (``native``'s docstring).
"""

from __future__ import annotations

import torch

from .native import _groups, _Library
from .pieces import Pieces

FIRST_CAPACITY = 4096  # excess entries the first call has room for; more take a second call of the exact size


def clipped_excess(values: torch.Tensor | Pieces, groups: torch.Tensor, scales: torch.Tensor,
                   over: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indices, ascending; float32 ``x - clamp(x, -s, s)``) of the elements ``x`` of flat float32 ``values``
    (contiguous, CPU; or its ``Pieces``) above their group's scale ``s`` in magnitude: ``scales`` float32 ``[G]``,
    ``groups`` int64 lengths ``[G]`` splitting ``values``. Only the groups where ``over`` (bool ``[G]``) is set are
    read: a group none of whose values is above its scale may be left unset."""
    values = Pieces.of(values)
    ends, limits, _ = _groups(groups, scales, values.numel)
    check = over.to("cpu", torch.uint8).contiguous()
    if check.shape != ends.shape:
        raise ValueError(f"{check.numel()} clipping flags for {ends.numel()} scale groups")
    found = torch.zeros(1, dtype=torch.int64)
    capacity = FIRST_CAPACITY
    while True:
        indices, excess = torch.empty(capacity, dtype=torch.int64), torch.empty(capacity, dtype=torch.float32)
        _Library.handle.hvdcomp_clip_excess(*values.arguments(), ends.data_ptr(), limits.data_ptr(),
                                            check.data_ptr(), ends.numel(), capacity, indices.data_ptr(),
                                            excess.data_ptr(), found.data_ptr())
        count = int(found)
        if count <= capacity:
            return indices[:count], excess[:count]
        capacity = count
