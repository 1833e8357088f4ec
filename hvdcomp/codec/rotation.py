"""A randomized Hadamard rotation of each scale group, shared by every worker: max-norm levels of the rotated values.

A max-norm quantizer's error per element is bounded by ``(M / s)**2 / 4`` with ``M`` the group's largest magnitude,
so one outlier sets the error of every element of its group. Rotating a group of ``n`` values by ``R = H D``
(``D``: random signs, ``H``: the normalized Hadamard matrix, orthogonal and symmetric) spreads its norm evenly:
each rotated value is a sum of ``n`` terms of random signs, so the rotated maximum is about ``|x| sqrt(2 ln n / n)``
whatever the outliers (THC, SDP4Bit). The rotation is linear and every worker uses the same one (the signs come from
a stream keyed by seed, key and step, without the rank), so rotated levels still sum across workers and the inverse
rotation of the decoded mean is the mean.

**Blocks.** Each scale group (``MaxNormQuantizer.scale_groups``: a tensor or a chunk) is cut into power-of-two
blocks from its start: blocks of ``MAX_BLOCK`` (``2**16``) elements while they fit, then the binary digits of the
rest in decreasing order (a group of 100 elements: 64, 32, 4). No padding: the rotated vector has the group's size,
and each block is rotated on its own (a block of one element only has its sign flipped).

**Order of operations** (the eager reference here and the native kernel, ``native_kernels.cpp``, do the same float32
operations in the same order, bit for bit): forward, ``x * sign``, then ``log2 b`` butterfly levels ``h = 1, 2, 4,
..., b / 2`` (``(u, v) -> (u + v, u - v)`` for elements ``j`` and ``j + h`` of each ``2 h`` run), then ``* b**-1/2``
(rounded to float32); inverse, the levels, the factor, then the sign. Element ``i`` of the vector has the sign of
uniform ``i`` of the stream (``hvdcomp.codec.random``): ``-1`` above 1/2.

**Statistics.** The levels of the rotated values are unbiased, so (the rotation being linear and fixed given the
stream) the decoded mean is unbiased. The rounding errors of the rotated values are independent with variance at
most ``(M_R / s)**2 / 4`` each, ``M_R`` the group's rotated maximum; each original element is a unit-norm
combination of them, so its variance is at most ``(M_R / s)**2 / 4`` too: the bound of the unrotated codec with
``M_R`` for ``M`` (docs/rotation.md).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from . import native
from .random import stream_words, uniform
from .validate import check_groups

MAX_BLOCK = 1 << 16  # the largest block rotated as one (elements)


def block_runs(groups: torch.Tensor, max_block: int = MAX_BLOCK) -> list[tuple[int, int, int]]:
    """``(start, block, count)`` of each run of ``count`` consecutive blocks of ``block`` elements from ``start``:
    the blocks of every scale group (int64 lengths, see the module docstring), runs of equal blocks merged."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for length in groups.tolist():
        full, rest = divmod(length, max_block)
        pieces = [(max_block, full)] if full else []
        pieces += [(1 << bit, 1) for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]
        for block, count in pieces:
            if runs and runs[-1][1] == block and runs[-1][0] + runs[-1][1] * runs[-1][2] == start:
                runs[-1] = (runs[-1][0], block, runs[-1][2] + count)
            else:
                runs.append((start, block, count))
            start += block * count
    return runs


def _signs(numel: int, words: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float32 ``[numel]``: ``-1`` where uniform ``i`` of the stream ``words`` is above 1/2, else ``+1``."""
    draws = uniform(numel, words.to(device))
    return torch.where(draws > 0.5, -1.0, 1.0)


def _butterflies(values: torch.Tensor, scratch: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """The Hadamard levels of every block of ``runs``, then its factor ``b**-1/2``, in ``values`` (``scratch``: float32
    of ``values``' size, overwritten)."""
    for start, block, count in runs:
        span = slice(start, start + block * count)
        source, target = values[span], scratch[span]
        half = 1
        while half < block:
            pairs = source.view(count, block // (2 * half), 2, half)
            out = target.view(count, block // (2 * half), 2, half)
            torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
            torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
            source, target = target, source
            half *= 2
        if source.data_ptr() != values[span].data_ptr():
            values[span].copy_(source)
        values[span].mul_(1.0 / math.sqrt(block))


class HadamardRotation:
    """The shared rotation of a max-norm codec's values (see the module docstring), with its buffers.

    Args:
        seed: with the bucket key and the step, keys the signs: the same on every worker (no rank).
        max_block: the largest block, a power of two in ``[1, MAX_BLOCK]``.
    """

    def __init__(self, seed: int = 0, max_block: int = MAX_BLOCK) -> None:
        if max_block < 1 or max_block > MAX_BLOCK or max_block & (max_block - 1):
            raise ValueError(f"max_block must be a power of two in [1, {MAX_BLOCK}], got {max_block!r}")
        self.seed = seed
        self.max_block = max_block
        self._rotated: dict[Hashable, torch.Tensor] = {}  # per key, the rotated values, reused every step
        self._scratch: torch.Tensor | None = None  # the eager butterflies' other buffer

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rotated": {}, "_scratch": None}

    def stream(self, key: Hashable, step: int, device: torch.device) -> torch.Tensor:
        """The signs' stream words for ``key`` at ``step`` (int64 ``[4]``), the same on every worker."""
        return stream_words(step, self.seed, "rotation", key, device=device)

    def forward(self, x: torch.Tensor, groups: torch.Tensor, key: Hashable, step: int) -> torch.Tensor:
        """float32 ``[numel]``: flat ``x`` rotated in the blocks of ``groups`` (``x`` is not written): a buffer of
        ``key``, valid until its next ``forward``."""
        check_groups(groups, x.numel())
        flat = x.detach().reshape(-1)
        rotated = self._rotated.get(key)
        if rotated is None or rotated.numel() != flat.numel() or rotated.device != flat.device:
            rotated = self._rotated[key] = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        rotated.copy_(flat)
        return self._apply(rotated, groups, self.stream(key, step, flat.device), inverse=False)

    def inverse_(self, rotated: torch.Tensor, groups: torch.Tensor, key: Hashable, step: int) -> torch.Tensor:
        """``rotated`` (contiguous float32, flat) rotated back in place: the inverse of ``forward`` of ``key`` at
        ``step``; returns it."""
        check_groups(groups, rotated.numel())
        return self._apply(rotated, groups, self.stream(key, step, rotated.device), inverse=True)

    def _apply(self, values: torch.Tensor, groups: torch.Tensor, words: torch.Tensor, inverse: bool) -> torch.Tensor:
        """The rotation or its inverse of contiguous float32 ``values`` in place (native kernel on the CPU)."""
        if native.usable(values):
            return native.rotate(values, groups, self.max_block, words, inverse)
        signs = _signs(values.numel(), words, values.device)
        if not inverse:
            values.mul_(signs)
        scratch = self._scratch
        if scratch is None or scratch.numel() < values.numel() or scratch.device != values.device:
            scratch = self._scratch = torch.empty(values.numel(), dtype=torch.float32, device=values.device)
        _butterflies(values, scratch[:values.numel()], block_runs(groups, self.max_block))
        return values.mul_(signs) if inverse else values
