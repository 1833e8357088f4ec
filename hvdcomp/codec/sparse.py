"""Random-k's per-element passes over a bucket: gather the chosen coordinates, keep the rest, scatter the mean.

Pure tensor math, no collectives (the exchange is ``hvdcomp.exchange.elementwise.MaxNormCodec`` with a
selector; the coordinates come from ``selection``). ``indices`` are sorted, distinct int64 positions in the
flat float32 bucket.

``gather`` runs as one fused kernel (``hvdcomp.codec.fused``): the NaN/Inf check of the whole bucket (a pass
over every element, the costliest part when eager) and the gather of the chosen values, plus their
error-feedback residuals, in one call. The memory update and the scatter stay eager, in
place: ``residual += flat`` then zeroing the sent residuals, and zeroing a reused output then writing the mean
at ``indices``, are each one pass over the bucket and one over k; compiled, Inductor functionalizes such an
update (a new bucket-sized buffer, then a copy back), which is slower (docs/benchmarks.md#kernel-level-measurements).
"""

from __future__ import annotations

import torch

from .fused import FusedKernel


def _gather_eager(flat: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat[indices]`` and the 0-d bool "no element of ``flat`` is NaN or ±Inf"."""
    return flat[indices], torch.isfinite(flat).all()


def _gather_with_memory_eager(flat: torch.Tensor, indices: torch.Tensor,
                              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat[indices] + residual[indices]`` (one rounding) and ``_gather_eager``'s flag."""
    values, finite = _gather_eager(flat, indices)
    return values.add_(residual[indices]), finite


_gather = FusedKernel(_gather_eager)
_gather_with_memory = FusedKernel(_gather_with_memory_eager)


def gather(flat: torch.Tensor, indices: torch.Tensor,
           residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen values, float32 ``[k]``: ``flat[indices]`` plus, with error feedback, ``residual[indices]``
    (``residual``: float32, ``flat``'s shape); and a 0-d bool tensor, True when no element of the whole
    ``flat`` (chosen or not) is NaN or ±Inf. One fused pass; the inputs are not modified."""
    if residual is None:
        return _gather(flat, indices)
    return _gather_with_memory(flat, indices, residual)


def keep_unsent(residual: torch.Tensor, flat: torch.Tensor, indices: torch.Tensor) -> None:
    """Error-feedback update in place: ``residual += flat``, then ``residual[indices] = 0`` (what was sent)."""
    residual.add_(flat).index_fill_(0, indices, 0.0)


def scatter(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
            factor: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (float32 ``[numel]``, overwritten and returned): ``values`` (float32 ``[k]``; times ``factor``,
    float32 ``[k]``, in place, if given) at ``indices``, 0 elsewhere."""
    if factor is not None:
        values = values.mul_(factor)
    return out.zero_().index_copy_(0, indices, values)
