"""Scales agreed one exchange ahead, and the excess of the elements clipped to them (no collectives).

A max-norm exchange with its scale agreed ahead quantizes with the scale ``M`` every worker agreed at
the tensor's previous exchange, so it needs no MAX round before its payload. An element above ``M`` is
sent as ``sign(x) * M`` and its excess ``x - sign(x) * M`` stays with this worker, added to the tensor's
next values (delayed, never lost). ``AgreedScales`` keeps both per key; the protocols that carry the
next scale live above (``hvdcomp.exchange.ahead``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from . import native
from .native_excess import clipped_excess
from .pieces import Pieces, ascending_within
from .quantize import MaxNormQuantizer


class AgreedScales:
    """Per key: the agreed scale_stats (float32 ``[G + 1]``: a scale per group, then 0) for an exchange of
    ``numel`` elements over ``W`` workers, and the clipped excess (int64 indices, float32 values)."""

    def __init__(self) -> None:
        self._scales: dict[Hashable, tuple[int, int, torch.Tensor]] = {}
        self._excess: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self._work: dict[Hashable, torch.Tensor] = {}  # values + excess, reused every step

    def scales(self, key: Hashable, numel: int, world_size: int, groups: int) -> torch.Tensor | None:
        """The scale_stats agreed for ``key``'s exchange of ``numel`` elements over ``world_size`` workers in ``groups``
        scale groups, or None (also where the agreed scale_stats do not have ``groups + 1`` values: e.g. state saved
        with another ``chunk_size``)."""
        agreed = self._scales.get(key)
        if agreed is None or agreed[:2] != (numel, world_size) or agreed[2].shape != (groups + 1,):
            return None
        return agreed[2]

    def with_excess(self, key: Hashable, flat: torch.Tensor, pieces: Pieces | None = None) -> torch.Tensor | Pieces:
        """``flat`` plus the excess clipped from ``key``'s earlier exchanges (``flat`` itself when there is
        none, else a buffer reused every step); ``flat`` is never written. With ``pieces`` (the values, which
        ``flat``, the caller's scratch, does not hold): ``pieces`` with the excess riding along as their addend
        (``Pieces.plus``: the kernels add it where they read; no copy)."""
        excess = self._excess.get(key)
        if excess is None or excess[0].numel() == 0:
            return flat if pieces is None else pieces
        if pieces is not None:
            return pieces.plus(*excess)
        work = self._work.get(key)
        if work is None or work.numel() != flat.numel() or work.device != flat.device:
            work = self._work[key] = torch.empty_like(flat)
        summed = work.copy_(flat)
        indices, values = excess
        return summed.index_add_(0, indices.to(flat.device), values.to(flat.device))

    def agree(self, key: Hashable, numel: int, world_size: int, reduced: torch.Tensor) -> bool:
        """Record the MAX-reduced ``local_stats`` of ``key``'s exchange as its next agreed scale; after a
        step in which a worker saw NaN/Inf, forget it instead (the next exchange is exact). Returns
        whether every worker's values were finite."""
        if MaxNormQuantizer.saw_nonfinite(reduced):
            self._scales.pop(key, None)
            return False
        scale_stats = torch.cat([reduced[:-1].float(), reduced.new_zeros(1, dtype=torch.float32)])
        self._scales[key] = (numel, world_size, scale_stats)
        return True

    @staticmethod
    def clipped(values: torch.Tensor | Pieces, local: torch.Tensor, scale_stats: torch.Tensor,
                groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 indices, float32 excess beyond the agreed scale) of the elements of flat ``values`` (or its
        ``Pieces``, read natively) above it; ``local`` is ``values``'s own ``local_stats``, ``scale_stats`` the agreed
        ones, over ``groups``."""
        scales = scale_stats[:-1]
        over = local[:-1] > scales
        if not bool(over.any()):
            return torch.empty(0, dtype=torch.int64, device=local.device), local.new_empty(0)
        if isinstance(values, Pieces) or native.usable(values):  # one read of the groups that clipped
            return clipped_excess(values, groups, scales, over)  # (docs/benchmarks.md#the-clipped-excess)
        limit = scales if groups.numel() <= 1 else scales.repeat_interleave(groups.to(values.device))
        indices = (values.abs() > limit.expand_as(values)).nonzero().squeeze(1)
        picked = values[indices]
        bound = limit.expand_as(values)[indices]
        return indices, picked - picked.clamp(-bound, bound)

    def keep_excess(self, key: Hashable, excess: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """What this worker still owes for ``key``: ``excess`` from ``clipped``, or None once all was sent."""
        if excess is not None and excess[0].numel():
            self._excess[key] = excess
        else:
            self._excess.pop(key, None)

    def state_dict(self) -> dict[str, Any]:
        """The agreed scales and the excess memory (what a resumed run needs to continue exactly)."""
        return {"scales": {key: (numel, size, scales.clone()) for key, (numel, size, scales) in self._scales.items()},
                "excess": {key: (indices.clone(), values.clone()) for key, (indices, values) in self._excess.items()}}

    @staticmethod
    def check_state(state: Any) -> None:
        """``ValueError`` unless ``state`` is a ``state_dict()``: per key ``(numel, world_size, scales)`` with finite,
        non-negative float32 scales ending in a 0 flag, and ``(indices, excess)`` of strictly ascending non-negative
        int64 indices and as many finite float32 values."""
        if not isinstance(state, dict) or set(state) != {"scales", "excess"}:
            raise ValueError(f"not an agreed-scale state: {state!r:.200}")
        for key, (_, _, scale_stats) in state["scales"].items():
            if (not isinstance(scale_stats, torch.Tensor) or scale_stats.dtype != torch.float32
                    or scale_stats.dim() != 1 or not scale_stats.numel()):
                raise ValueError(f"the agreed scales of {key!r} are not a float32 vector: {scale_stats!r:.200}")
            if not bool(torch.isfinite(scale_stats).all()) or bool((scale_stats < 0).any()) or scale_stats[-1] != 0:
                raise ValueError(f"the agreed scales of {key!r} are not finite, non-negative and flagged finite: "
                                 f"{scale_stats.tolist()[:8]}")
        for key, (indices, values) in state["excess"].items():
            if (indices.dtype != torch.int64 or values.dtype != torch.float32 or indices.dim() != 1
                    or indices.shape != values.shape):
                raise ValueError(f"the clipped excess of {key!r} has {indices.dtype} indices {tuple(indices.shape)} "
                                 f"and {values.dtype} values {tuple(values.shape)}")
            if not ascending_within(indices):
                raise ValueError(f"the clipped excess of {key!r} is not at ascending places")
            if not bool(torch.isfinite(values).all()):
                raise ValueError(f"the clipped excess of {key!r} is not finite")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._scales = {key: (numel, size, scales.clone()) for key, (numel, size, scales) in state["scales"].items()}
        self._excess = {key: (indices.clone(), values.clone()) for key, (indices, values) in state["excess"].items()}
