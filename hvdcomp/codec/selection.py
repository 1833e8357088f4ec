"""Shared random coordinate sets (GlobalRandK): the same indices on every worker, no communication.

The set for ``(seed, key, step)`` is block ``step % blocks`` of a permutation of all coordinates drawn
from a dedicated generator seeded by ``(seed, key, step // blocks)``, where ``blocks = numel // k``.
Each step's set is therefore a uniformly random k-subset (every coordinate is picked with probability
``k / numel``), consecutive steps of a cycle are disjoint, and one permutation serves ``blocks`` steps.
The global RNGs are never touched.
"""

from __future__ import annotations

import torch

from .seeding import stable_seed
from .validate import check_int, check_real


class RandomCoordinateSelector:
    """Chooses ``k`` of ``numel`` coordinates per (key, step), identically on every worker.

    Args:
        k: coordinates per step (``1 <= k <= numel``), or
        ratio: fraction of coordinates per step in (0, 1]; ``k = max(1, round(ratio * numel))``.
        seed: shared seed; every worker must pass the same value.
    """

    def __init__(self, k: int | None = None, ratio: float | None = None, seed: int = 0) -> None:
        if (k is None) == (ratio is None):
            raise ValueError("give exactly one of k and ratio")
        self.k = None if k is None else check_int("k", k, 1)
        self.ratio = None if ratio is None else check_real("ratio", ratio, 0.0, 1.0, low_open=True, high_open=False)
        self.seed = seed
        self._cycles: dict[object, tuple[int, int, torch.Tensor]] = {}

    def count(self, numel: int) -> int:
        """Coordinates chosen from a tensor of ``numel >= 1`` elements: ``min(k, numel)`` (a tensor smaller
        than ``k``, e.g. a bias, is sent whole), or ``max(1, round(ratio * numel))``."""
        if self.k is not None:
            return min(self.k, numel)
        return max(1, round(self.ratio * numel))

    def indices(self, numel: int, key: object, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Sorted int64 indices ``[k]`` for this tensor (``key``) at ``step``."""
        k = self.count(numel)
        blocks = numel // k
        cycle = step // blocks
        cached = self._cycles.get(key)
        if cached is None or cached[0] != numel or cached[1] != cycle:
            generator = torch.Generator().manual_seed(stable_seed(self.seed, key, cycle))
            perm = torch.randperm(numel, generator=generator)[: blocks * k].view(blocks, k)
            perm = perm.sort(dim=1).values.to(torch.int32 if numel < 2**31 else torch.int64)
            cached = (numel, cycle, perm)
            self._cycles[key] = cached
        return cached[2][step % blocks].to(device=device, dtype=torch.int64)
