"""Birder's 1-bit math: the unbiased direction, binary randomization, and means from counts of +1s.

Pure tensor math, no collectives (the 1-bit exchanges are ``hvdcomp.exchange.onebit``). A ±1 value
travels as a bit, True (1) for +1.

The per-element passes of a Birder step run as fused kernels (``hvdcomp.codec.fused``): ``gradient_checks``,
``update_moments`` (both moments and the probability of +1 in one pass, in place), ``mean_from_lane_sums``
(unpack and mean) and ``zero_inactive``.
"""

from __future__ import annotations

import torch

from .fused import FusedKernel
from .packing import LaneLayout, unpack_lanes


def unbiased_direction(m: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``z = m / b`` in [-1, 1], 0 where ``b == 0`` (``|m| <= b`` up to rounding; clamped)."""
    z = torch.div(m, b, out=out) if out is not None else m / b
    return z.masked_fill_(b <= 0, 0.0).clamp_(-1.0, 1.0)


def plus_probability(m: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(1 + z) / 2`` for ``z = unbiased_direction(m, b)``: the probability of drawing +1."""
    return unbiased_direction(m, b, out=out).add_(1.0).mul_(0.5)


def _update_moments_eager(m: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, beta: float,
                          prob_out: torch.Tensor) -> None:
    """``update_moments`` with explicit roundings (no fused multiply-add: fused and eager round alike);
    ``prob_out`` serves as scratch before it gets the probability."""
    m.mul_(beta).add_(torch.mul(grad, 1.0 - beta, out=prob_out))
    b.mul_(beta).add_(torch.abs(grad, out=prob_out).mul_(1.0 - beta))
    plus_probability(m, b, out=prob_out)


_update_moments = FusedKernel(_update_moments_eager, in_place=True)


def update_moments(m: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, beta: float,
                   prob_out: torch.Tensor) -> None:
    """In place, one fused pass over float32 ``[n]`` buffers (no allocation): ``m <- beta m + (1 - beta) g``,
    ``b <- beta b + (1 - beta) |g|``, ``prob_out <- plus_probability(m, b)``."""
    _update_moments(m, b, grad, float(beta), prob_out)


def _all_finite_eager(grad: torch.Tensor) -> torch.Tensor:
    """0-d bool: no element of ``grad`` is NaN or ±Inf."""
    return torch.isfinite(grad).all()


def _checks_with_mask_eager(grad: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d bools: ``_all_finite_eager(grad)``; some element outside ``active`` has a non-zero gradient."""
    return _all_finite_eager(grad), grad.ne(0).logical_and_(active.logical_not()).any()


_all_finite = FusedKernel(_all_finite_eager)
_checks_with_mask = FusedKernel(_checks_with_mask_eager)


def gradient_checks(grad: torch.Tensor, active: torch.Tensor | None = None) -> tuple[bool, bool]:
    """``(finite, fresh)`` in one fused pass: no element of ``grad`` is NaN or ±Inf; some element outside the
    bool mask ``active`` (``grad``'s shape; None: every element is active) has a non-zero gradient."""
    if active is None:
        return bool(_all_finite(grad)), False
    finite, fresh = _checks_with_mask(grad, active)
    return bool(finite), bool(fresh)


def _zero_inactive_eager(values: torch.Tensor, active: torch.Tensor) -> None:
    """``values`` <- 0 where ``active`` is False."""
    values.masked_fill_(active.logical_not(), 0.0)


zero_inactive = FusedKernel(_zero_inactive_eager, in_place=True)


def binarize(prob_plus: torch.Tensor, generator: torch.Generator | None,
             rand_out: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bits (True for +1) that are 1 with probability ``prob_plus`` (float, in [0, 1]) each.

    ``rand_out`` / ``out`` are optional preallocated float / bool buffers of ``prob_plus``'s shape.
    """
    if rand_out is None:
        rand = torch.rand(prob_plus.shape, generator=generator, device=prob_plus.device, dtype=prob_plus.dtype)
    else:
        rand = torch.rand(prob_plus.shape, generator=generator, out=rand_out)
    return torch.lt(rand, prob_plus, out=out) if out is not None else rand < prob_plus


def signs_from_direction(z: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The ±1 draw ``u`` as float32: +1 with probability ``(1 + z) / 2`` (``E[u] = z``)."""
    bits = binarize((z + 1) * 0.5, generator)
    return bits_to_signs(bits)


def bits_to_signs(bits: torch.Tensor) -> torch.Tensor:
    """float32 ±1 from bits (True for +1)."""
    return bits.to(torch.float32).mul_(2).sub_(1)


def mean_from_counts(counts: torch.Tensor, group: int) -> torch.Tensor:
    """``(2 count - group) / group`` as float32: the mean of ``group`` ±1 values with ``count`` +1s."""
    return counts.mul(2).sub_(group).to(torch.float32).div_(group)


def _mean_from_words_eager(word_sums: torch.Tensor, shifts: torch.Tensor, mask: int, numel: int, group: int,
                           out: torch.Tensor) -> None:
    """``out`` (float32 ``[numel]``) <- ``mean_from_counts`` of the lanes of ``word_sums``."""
    out.copy_(mean_from_counts(unpack_lanes(word_sums, shifts, mask, numel), group))


_mean_from_words = FusedKernel(_mean_from_words_eager, in_place=True)


def mean_from_lane_sums(word_sums: torch.Tensor, layout: LaneLayout, numel: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[numel]``: the mean of ``layout.world_size`` workers' ±1 values from the sums of their bits'
    words (``layout``: ``span=1``, no offset), in one fused pass, written into ``out`` if given."""
    if layout.span != 1 or layout.offset:
        raise ValueError(f"mean_from_lane_sums needs a layout of bits (span 1, offset 0), got {layout}")
    layout.check_words(word_sums, numel)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=word_sums.device)
    elif out.dtype != torch.float32 or out.shape != (numel,):
        raise ValueError(f"out must be float32 of shape ({numel},), got {out.dtype} {tuple(out.shape)}")
    _mean_from_words(word_sums, layout.lane_shifts(word_sums.device), layout.lane_mask, numel, layout.world_size,
                     out)
    return out
