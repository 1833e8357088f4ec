"""Low-rank math for PowerSGD: column orthonormalization and flat packing of tensor lists.

Pure tensor math, no collectives (the PowerSGD exchange is ``hvdcomp.exchange.powersgd``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def orthogonalize(matrices: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Orthonormalize the columns of each ``[k, r]`` matrix of a ``[B, k, r]`` batch in place.

    Modified Gram-Schmidt, vectorised over the batch and, for the projections, over columns: column
    ``i`` is divided by ``norm + epsilon`` and then projected out of all later columns at once. With
    ``r > 1`` a second pass (``epsilon`` 0) restores the orthogonality that one pass loses on
    ill-conditioned inputs ("twice is enough"). With ``epsilon == 0`` a zero column stays zero
    instead of becoming NaN.
    """
    num_cols = matrices.shape[2]
    for eps in (epsilon, 0.0) if num_cols > 1 else (epsilon,):
        for i in range(num_cols):
            col = matrices[:, :, i : i + 1]
            norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
            norm = norm + eps if eps else torch.where(norm > 0, norm, torch.ones_like(norm))
            col.div_(norm)
            if i + 1 < num_cols:
                rest = matrices[:, :, i + 1 :]
                rest.sub_(col * (col * rest).sum(dim=1, keepdim=True))
    return matrices


def split_views(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` of the given sizes."""
    views, offset = [], 0
    for size in sizes:
        views.append(flat[offset : offset + size])
        offset += size
    return views


def flatten_into(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensors flattened and concatenated in ``dtype`` (into ``out`` if given)."""
    if out is None:
        out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    for tensor, view in zip(tensors, split_views(out, [t.numel() for t in tensors])):
        view.copy_(tensor.reshape(-1))
    return out


def unflatten_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped and typed like ``like`` (views where the dtype already matches)."""
    return [view.view(t.shape).to(t.dtype) for t, view in zip(like, split_views(flat, [t.numel() for t in like]))]
