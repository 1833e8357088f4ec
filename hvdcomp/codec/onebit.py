"""Birder's 1-bit math: the unbiased direction, binary randomization, and means from counts of +1s.

Pure tensor math, no collectives (the 1-bit exchanges are ``hvdcomp.exchange.onebit``). A ±1 value
travels as a bit, True (1) for +1.
"""

from __future__ import annotations

import torch


def unbiased_direction(m: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``z = m / b`` in [-1, 1], 0 where ``b == 0`` (``|m| <= b`` up to rounding; clamped)."""
    z = torch.div(m, b, out=out) if out is not None else m / b
    return z.masked_fill_(b <= 0, 0.0).clamp_(-1.0, 1.0)


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
