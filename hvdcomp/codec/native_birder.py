"""The native kernels of Birder's per-parameter passes (``hvdcomp.integrations.birder``), through ctypes.

Gathering the gradients into the flat buffer with the step's checks in the same pass, and the update of each
parameter (decay and step in one pass): each computes what ``hvdcomp.codec.onebit``'s eager reference computes, bit
for bit (``tests/test_native.py``). Both take a list of tensors as their addresses, sizes and offsets; the wrappers
check every tensor and span they hand the kernels, and the kernels refuse spans past the buffer they are given
(``native``'s docstring). Both split their values over the torch threads (``native._in_parallel``), as the
ATen ops they replace do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .native import _checked, _in_parallel, _Library

_TILE = 4096  # native_kernels.cpp's kChunk: threads split the values in whole tiles


def _spans(tensors: Sequence[torch.Tensor], offsets: Sequence[int], numel: int) -> tuple[torch.Tensor, ...]:
    """The addresses, sizes and offsets (int64 ``[k]`` each) of float32 ``tensors`` (each ``usable``) laid at
    ``offsets`` of a buffer of ``numel`` elements, checked: each span within it."""
    if len(tensors) != len(offsets):
        raise ValueError(f"{len(tensors)} tensors for {len(offsets)} offsets")
    for index, (tensor, offset) in enumerate(zip(tensors, offsets)):
        _checked(f"tensor {index}", tensor, torch.float32)
        if offset < 0 or offset + tensor.numel() > numel:
            raise ValueError(f"tensor {index} ({tensor.numel()} elements at {offset}) is not within {numel} elements")
    return (torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64),
            torch.tensor([t.numel() for t in tensors], dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64))


def gather_checked(sources: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor,
                   active: torch.Tensor | None) -> tuple[bool, bool]:
    """``onebit.gather_checked``: ``sources`` (contiguous float32, CPU; a view of ``flat`` at its own offset is not
    copied) into flat float32 ``flat`` at ``offsets``; ``(finite, fresh)`` of ``flat``, ``active`` (contiguous bool,
    ``flat``'s size; None: all active) in the same pass."""
    numel = _checked("flat", flat, torch.float32).numel()
    if active is not None:
        _checked("the active mask", active, torch.bool, numel)
    addresses, sizes, starts = _spans(sources, offsets, numel)
    lib, found = _Library.handle, []

    def run(first: int, last: int) -> None:
        flags = torch.zeros(2, dtype=torch.int64)
        lib.hvdcomp_gather_checked(addresses.data_ptr(), sizes.data_ptr(), starts.data_ptr(), len(sources),
                                   flat.data_ptr(), numel, None if active is None else active.data_ptr(),
                                   flags.data_ptr(), first, last)
        found.append(flags)

    _in_parallel(run, _whole_tiles(sizes), _TILE)
    flags = torch.stack(found).amax(0) if found else torch.zeros(2, dtype=torch.int64)
    return not flags[0].item(), bool(flags[1].item())


def birder_update(params: Sequence[torch.Tensor], offsets: Sequence[int], keeps: Sequence[float],
                  steps: Sequence[float], mean: torch.Tensor) -> None:
    """``onebit.apply_updates`` of contiguous float32 ``params`` (CPU) from float32 ``mean`` at ``offsets``."""
    numel = _checked("mean", mean, torch.float32).numel()
    if not len(params) == len(keeps) == len(steps):
        raise ValueError(f"{len(params)} parameters for {len(keeps)} decays and {len(steps)} steps")
    addresses, sizes, starts = _spans(params, offsets, numel)
    decays = torch.tensor(keeps, dtype=torch.float32)
    moves = torch.tensor(steps, dtype=torch.float32)
    lib = _Library.handle

    def run(first: int, last: int) -> None:
        lib.hvdcomp_birder_update(addresses.data_ptr(), sizes.data_ptr(), starts.data_ptr(), decays.data_ptr(),
                                  moves.data_ptr(), len(params), mean.data_ptr(), numel, first, last)

    _in_parallel(run, _whole_tiles(sizes), _TILE)


def _whole_tiles(sizes: torch.Tensor) -> int:
    """The values of all spans, rounded up to whole tiles (what ``_in_parallel`` splits; the kernels stop at the
    spans' end)."""
    return -(-int(sizes.sum()) // _TILE) * _TILE
