"""Birder's 1-bit math: the draw of ±1 values with mean ``z = m / b``, binary randomization, and means from
counts of +1s.

Pure tensor math, no collectives (the 1-bit exchanges are ``hvdcomp.exchange.onebit``). A ±1 value
travels as a bit, True (1) for +1.

Draws are counter-based (``hvdcomp.codec.random``): element ``i`` of a draw from the stream ``rng`` (int64
``[4]`` words of ``stream_words``) compares uniform ``first + i`` of that stream with its probability, so a draw
is a pure function of (seed, purpose, rank, step, element): the same bits eagerly or fused, on CPU or GPU, in
any order and any chunking, after any resume.

The per-element passes of a Birder step run as fused kernels (``hvdcomp.codec.fused``): ``gradient_checks`` (on
the CPU in the pass that gathers the gradients into the flat buffer: ``gather_checked``),
``update_moments`` (both moments in one pass, in place), ``draw_lane_words`` / ``draw_bits`` (the draw from
``m`` and ``b``, and the lane packing, in one pass; on the CPU ``draw_lane_words`` updates the moments in that
pass too, and so does ``draw_bits``), ``binarize``, ``mean_from_lane_sums`` (unpack and mean) and
``zero_inactive``; on the CPU ``pack_bit_rows``, ``unpack_bit_rows`` and ``count_bit_rows`` (the bytes of the
two-stage and hierarchical exchanges) run natively too, and so does ``apply_updates`` (decay and step in one pass
over each parameter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import native, native_birder
from .fused import FusedKernel
from .packing import (
    LaneLayout,
    as_uint8,
    bits_to_bytes,
    bytes_to_bits,
    in_lane_blocks,
    in_word_blocks,
    lane_block_values,
    lane_block_words,
    map_lane_blocks,
    pack_lane_blocks,
)
from .random import OUTPUTS_PER_BLOCK, uniform


def _update_moments_eager(m: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, beta: float) -> None:
    """``update_moments`` with explicit roundings (no fused multiply-add: fused and eager round alike)."""
    m.mul_(beta).add_(grad * (1.0 - beta))
    b.mul_(beta).add_(grad.abs().mul_(1.0 - beta))


_update_moments = FusedKernel(_update_moments_eager, in_place=True)


def update_moments(m: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, beta: float) -> None:
    """In place, one fused pass over float32 ``[n]`` buffers (no allocation): ``m <- beta m + (1 - beta) g``,
    ``b <- beta b + (1 - beta) |g|``."""
    _update_moments(m, b, grad, float(beta))


MomentRuns = Sequence[tuple[int, int, float]]
"""Ascending, disjoint ``[lo, hi)`` spans of the moment buffers, each with the ``beta`` that updates it."""


def update_moment_runs(m: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, runs: MomentRuns) -> None:
    """``update_moments`` of each run's span of ``m``, ``b`` from ``grad`` (float32 ``[n]``) with its beta."""
    if runs and grad is None:
        raise ValueError("updating the moments needs a gradient, got None")
    for lo, hi, beta in runs:
        update_moments(m[lo:hi], b[lo:hi], grad[lo:hi], beta)


def runs_within(runs: MomentRuns, lo: int, hi: int) -> list[tuple[int, int, float]]:
    """The parts of ``runs`` inside ``[lo, hi)``, shifted to start from ``lo``."""
    return [(max(a, lo) - lo, min(c, hi) - lo, beta) for a, c, beta in runs if a < hi and c > lo]


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


def gather_checked(sources: Sequence[torch.Tensor | None], offsets: Sequence[int], flat: torch.Tensor,
                   active: torch.Tensor | None = None) -> tuple[bool, bool]:
    """``flat`` (float32 ``[n]``) <- each of ``sources`` (a gradient of any floating dtype, flattened; None: zeros)
    at its offset, ``offsets`` laying them one after another over all of ``flat``; returns ``gradient_checks(flat,
    active)``. On the CPU the float32 ones are copied and checked in one pass."""
    ends = [*offsets[1:], flat.numel()]
    direct = native.usable(flat) and (active is None or native.usable(active, torch.bool))
    as_they_are = native.usable_each(sources) if direct else [False] * len(sources)
    spans = []
    for source, offset, end, fits in zip(sources, offsets, ends, as_they_are):
        part = flat[offset:end]
        if source is not None and source.numel() != part.numel():
            raise ValueError(f"a gradient of {source.numel()} elements for a span of {part.numel()}")
        if fits:
            spans.append(source.reshape(-1))
            continue
        if source is None:
            part.zero_()
        else:
            part.copy_(source.reshape(-1))
        spans.append(part)
    if direct:
        return native_birder.gather_checked(spans, offsets, flat, active)
    return gradient_checks(flat, active)


def _apply_update_eager(p: torch.Tensor, mean: torch.Tensor, keep: float, step: float) -> None:
    """``p <- p keep + step mean`` with explicit roundings (both products, then their sum), as the native kernel."""
    if keep != 1.0:  # p * 1 is p: the same bits
        p.mul_(keep)
    p.add_(mean.view_as(p).mul(step).to(p.dtype))


def apply_updates(params: Sequence[torch.Tensor], offsets: Sequence[int], keeps: Sequence[float],
                  steps: Sequence[float], mean: torch.Tensor) -> None:
    """In place, each parameter ``p`` of ``params`` <- ``p keep + step mean[offset: offset + p.numel()]`` (its
    ``keeps``, ``steps``, ``offsets``; ``mean`` float32 ``[n]``): Birder's ``x <- x (1 - lr lambda) - lr u_bar``. The
    float32 ones on the CPU in one native pass each (autograd learns they changed, as from an in-place op); no
    autograd history either way."""
    for p, offset in zip(params, offsets):
        if offset < 0 or offset + p.numel() > mean.numel():
            raise ValueError(f"a parameter of {p.numel()} elements at {offset} is not within the mean's {mean.numel()}")
    direct = native.usable_each(params) if native.usable(mean) else [False] * len(params)
    if any(direct):
        chosen = [i for i, fits in enumerate(direct) if fits]
        updated = [params[i] for i in chosen]
        native_birder.birder_update(updated, [offsets[i] for i in chosen], [keeps[i] for i in chosen],
                                    [steps[i] for i in chosen], mean)
        torch.autograd.graph.increment_version(updated)
    with torch.no_grad():
        for p, offset, keep, step, fits in zip(params, offsets, keeps, steps, direct):
            if not fits:
                _apply_update_eager(p, mean[offset:offset + p.numel()], keep, step)


def _zero_inactive_eager(values: torch.Tensor, active: torch.Tensor) -> None:
    """``values`` <- 0 where ``active`` is False."""
    values.masked_fill_(active.logical_not(), 0.0)


zero_inactive = FusedKernel(_zero_inactive_eager, in_place=True)


def _binarize_eager(prob_plus: torch.Tensor, rng: torch.Tensor, first: int = 0) -> torch.Tensor:
    noise = uniform(prob_plus.numel(), rng.to(prob_plus.device), first).view(prob_plus.shape)
    return noise < prob_plus


def _draw_eager(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Bits: ``V b < m`` for ``V = 2 U - 1`` uniform in [-1, 1) (``U`` uniform ``first + i`` of ``rng``), or ``V < 0``
    where ``b == 0``. Branch-free: no division, no clamp, the same cost for every ``z``."""
    v = uniform(m.numel(), rng.to(m.device), first) * 2.0 - 1.0
    return (v * b < m) | ((b == 0) & (v < 0))


def _draw_bits_eager(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` <- ``_draw_eager(m, b, rng)``."""
    out.copy_(_draw_eager(m, b, rng))


def _draw_lane_blocks_eager(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, shifts: torch.Tensor,
                            first: int, out: torch.Tensor) -> None:
    """``out`` <- the int64 words of ``_draw_eager(m, b, rng, first)`` (whole blocks) in the blocked order of
    ``shifts``' lanes."""
    out.copy_(pack_lane_blocks(_draw_eager(m, b, rng, first), shifts))


def _pack_bit_blocks_eager(bits: torch.Tensor, shifts: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` <- ``pack_lane_blocks(bits, shifts)`` (whole blocks)."""
    out.copy_(pack_lane_blocks(bits, shifts))


_binarize = FusedKernel(_binarize_eager)
_draw_bits = FusedKernel(_draw_bits_eager, in_place=True)
_draw_lane_blocks = FusedKernel(_draw_lane_blocks_eager, in_place=True)
_pack_bit_blocks = FusedKernel(_pack_bit_blocks_eager, in_place=True)


def binarize(prob_plus: torch.Tensor, rng: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Bits (bool, ``prob_plus``'s shape; True for +1): element ``i`` is True when uniform ``first + i`` of the
    stream ``rng`` (int64 ``[4]`` words, ``random.stream_words``) is below
    ``prob_plus[i]`` (float32 in [0, 1]), i.e. with that probability."""
    return _binarize(prob_plus, rng, first)


def binarize_counts(counts: torch.Tensor, group: int, length: int, rng: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Bits (bool ``[length]``): ``binarize`` of the probabilities ``counts / group`` (int64 ``[k]``, ``k <=
    length``, counts of +1s among ``group`` values; float32), then 0 up to ``length`` (always False), natively on
    the CPU."""
    if native.usable(counts, torch.int64) and counts.dim() == 1 and first % OUTPUTS_PER_BLOCK == 0:
        return native.binarize_counts(counts, group, length, rng, first)
    prob = torch.zeros(length, dtype=torch.float32, device=counts.device)
    prob[:counts.numel()] = counts.to(torch.float32).div_(group)
    return binarize(prob, rng, first)


def draw_bits(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None = None,
              runs: MomentRuns = ()) -> torch.Tensor:
    """``out`` (bool ``[n]``) <- the ±1 draw ``u`` of float32 moments ``m``, ``b`` ``[n]`` (``|m| <= b``): True (+1)
    with probability ``(1 + z) / 2`` for ``z = m / b`` (``E[u] = z``; 1/2 where ``b == 0``), from uniforms
    ``0 .. n - 1`` of the stream ``rng``, after ``update_moment_runs(m, b, grad, runs)``, in one fused pass (the
    moments in the same pass on the CPU); returns ``out``."""
    _check_moments(m, b, out)
    if (native.usable(m) and native.usable(b) and native.usable(out, torch.bool)
            and (not runs or grad is None or native.usable(grad))):
        return native.draw_bools(m, b, rng, out, grad, runs)
    update_moment_runs(m, b, grad, runs)
    _draw_bits(m, b, rng, out)
    return out


def _check_moments(m: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` unless ``b`` (and ``out``) have the shape of ``m``."""
    if b.shape != m.shape or (out is not None and out.shape != m.shape):
        shapes = [tuple(t.shape) for t in (m, b, out) if t is not None]
        raise ValueError(f"the moments m, b (and the draw's out) must have one shape, got {shapes}")


def pack_bit_rows(bits: torch.Tensor) -> torch.Tensor:
    """``packing.bits_to_bytes`` of bool ``[n]`` or ``[rows, n]`` (uint8 ``[..., ceil(n / 8)]``, least significant
    bit first), natively on the CPU."""
    if bits.dim() in (1, 2) and native.usable(bits, torch.bool):
        packed = native.pack_bits(bits.view(len(bits) if bits.dim() == 2 else 1, bits.shape[-1]))
        return packed if bits.dim() == 2 else packed[0]
    return bits_to_bytes(bits)


def unpack_bit_rows(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """``packing.bytes_to_bits(packed, numel)`` of uint8 ``[bytes]`` or ``[rows, bytes]``, natively on the CPU."""
    if packed.dim() in (1, 2) and native.usable(packed, torch.uint8) and packed.shape[-1] * 8 >= numel:
        bits = native.unpack_bits(packed.view(len(packed) if packed.dim() == 2 else 1, packed.shape[-1]), numel)
        return bits if packed.dim() == 2 else bits[0]
    return bytes_to_bits(packed, numel)


def count_bit_rows(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """int64 ``[numel]``: for each of the first ``numel`` bits, how many rows of uint8 ``[rows, bytes]`` (as
    ``pack_bit_rows`` packs them) have it set, natively on the CPU."""
    if packed.dim() == 2 and native.usable(packed, torch.uint8) and packed.shape[-1] * 8 >= numel:
        return native.count_bits(packed, numel)
    return bytes_to_bits(packed, numel).sum(dim=0, dtype=torch.int64)


def _check_bit_layout(layout: LaneLayout, caller: str) -> None:
    if layout.span != 1 or layout.offset:
        raise ValueError(f"{caller} needs a layout of bits (span 1, offset 0), got {layout}")


def bit_lane_words(bits: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """int64 ``[packing.lane_block_words(n, L)]``: bits (bool or 0/1 uint8 ``[n]``) in the summable lanes of
    ``layout`` (span 1, no offset) in the blocked order (``packing.pack_lane_blocks``; zero past ``n``), the
    words ``mean_from_lane_sums`` decodes."""
    _check_bit_layout(layout, "bit_lane_words")
    bits = as_uint8(bits.reshape(-1))
    shifts = layout.lane_shifts(bits.device)
    return in_lane_blocks(bits.numel(), shifts, lambda end, out: _pack_bit_blocks(bits[:end], shifts, out),
                          lambda end: bits[end:])


def draw_lane_words(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, layout: LaneLayout, first: int = 0,
                    grad: torch.Tensor | None = None, runs: MomentRuns = ()) -> torch.Tensor:
    """``bit_lane_words`` of the draw ``draw_bits(m, b, rng)``, from uniforms ``first ...`` of ``rng`` (elements
    ``first ...`` of a larger draw, the same bits), after ``update_moment_runs(m, b, grad, runs)``: the whole
    blocks in one fused pass (no bit or probability buffer; the moments in the same pass on the CPU), the last,
    partial one apart."""
    _check_bit_layout(layout, "draw_lane_words")
    _check_moments(m, b)
    if (native.usable(m) and native.usable(b) and first % OUTPUTS_PER_BLOCK == 0
            and (not runs or grad is None or native.usable(grad))):
        return native.draw_bit_words(m, b, rng, layout.lanes_per_word, layout.lane_width, first, grad, runs)
    update_moment_runs(m, b, grad, runs)
    shifts = layout.lane_shifts(m.device)
    return in_lane_blocks(m.numel(), shifts,
                          lambda end, out: _draw_lane_blocks(m[:end], b[:end], rng, shifts, first, out),
                          lambda end: _draw_eager(m[end:], b[end:], rng, first + end))


def bits_to_signs(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ±1 from bits (True for +1), into ``out`` (float32, ``bits``' shape) if given."""
    if out is None:
        return bits.to(torch.float32).mul_(2).sub_(1)
    return out.copy_(bits).mul_(2).sub_(1)


def _native_lanes(layout: LaneLayout, words: torch.Tensor) -> bool:
    return layout.offset == 0 and native.usable(words, torch.int64)


def pack_lane_values(layout: LaneLayout, values: torch.Tensor) -> torch.Tensor:
    """``layout.pack(values, validate=False)`` of int64 ``values`` ``[n]`` (consecutive lanes), natively on the
    CPU for layouts without an offset."""
    if _native_lanes(layout, values):
        return native.pack_lanes(values, layout.lanes_per_word, layout.lane_width)
    return layout.pack(values, validate=False)


def unpack_lane_values(layout: LaneLayout, words: torch.Tensor, numel: int) -> torch.Tensor:
    """``layout.unpack(words, numel)`` (int64 sums of consecutive lanes), natively on the CPU for layouts without
    an offset."""
    if _native_lanes(layout, words):
        layout.check_words(words, numel)
        return native.unpack_lanes(words, numel, layout.lanes_per_word, layout.lane_width)
    return layout.unpack(words, numel)


def mean_from_lane_counts(layout: LaneLayout, words: torch.Tensor, numel: int, group: int,
                          out: torch.Tensor) -> torch.Tensor:
    """``out`` (float32 ``[numel]``) <- ``mean_from_counts`` of ``layout.unpack(words, numel)``: the means of
    ``group`` ±1 values from their +1 counts, in one pass (natively on the CPU for layouts without an offset)."""
    if _native_lanes(layout, words) and native.usable(out):
        layout.check_words(words, numel)
        return native.lane_counts_mean(words, numel, layout.lanes_per_word, layout.lane_width, group, out)
    return mean_from_counts_into(layout.unpack(words, numel), group, out)


def mean_from_counts(counts: torch.Tensor, group: int) -> torch.Tensor:
    """``(2 count - group) / group`` as float32: the mean of ``group`` ±1 values with ``count`` +1s."""
    return counts.mul(2).sub_(group).to(torch.float32).div_(group)


def _mean_from_counts_into_eager(counts: torch.Tensor, group: int, out: torch.Tensor) -> None:
    out.copy_(mean_from_counts(counts, group))


_mean_from_counts_into = FusedKernel(_mean_from_counts_into_eager, in_place=True)


def mean_from_counts_into(counts: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (float32, ``counts``' shape) <- ``mean_from_counts(counts, group)`` of integer ``counts`` (any
    strides), in one fused pass; returns ``out``."""
    _mean_from_counts_into(counts, group, out)
    return out


def _mean_from_words_eager(word_sums: torch.Tensor, shifts: torch.Tensor, mask: int, group: int,
                           out: torch.Tensor) -> None:
    """``out`` (float32 ``[words * L]``) <- ``mean_from_counts`` of every lane of ``word_sums`` (whole blocks of
    the blocked order)."""
    out.copy_(map_lane_blocks(word_sums, shifts, mask, lambda counts, _: mean_from_counts(counts, group)))


_mean_from_words = FusedKernel(_mean_from_words_eager, in_place=True)


def mean_from_lane_sums(word_sums: torch.Tensor, layout: LaneLayout, numel: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[numel]``: the mean of ``layout.world_size`` workers' ±1 values from the sums of their
    ``bit_lane_words`` (``layout``: ``span=1``, no offset), in one fused pass per ``packing.DECODE_BLOCK_WORDS``
    words. It is a view of ``out`` if given: a 1-D float32 buffer of at least ``len(word_sums) *
    layout.lanes_per_word`` elements (whole blocks are decoded; ``n + bit_padding(layout)`` always suffice)."""
    _check_bit_layout(layout, "mean_from_lane_sums")
    lanes = layout.lanes_per_word
    if word_sums.dtype != torch.int64 or word_sums.dim() != 1:
        raise TypeError(f"expected 1-D int64 word sums, got {word_sums.dtype} {tuple(word_sums.shape)}")
    if word_sums.numel() != lane_block_words(numel, lanes):
        raise ValueError(f"{word_sums.numel()} words do not hold {numel} elements of {layout}")
    decoded = word_sums.numel() * lanes
    if out is None:
        out = torch.empty(decoded, dtype=torch.float32, device=word_sums.device)
    elif out.dtype != torch.float32 or out.dim() != 1 or out.numel() < decoded:
        raise ValueError(f"out must be 1-D float32 of at least {decoded} elements, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if native.usable(word_sums, torch.int64) and native.usable(out):
        native.counts_mean(word_sums, lanes, layout.lane_width, layout.world_size, out[:decoded])
        return out[:numel]
    shifts = layout.lane_shifts(word_sums.device)
    in_word_blocks(word_sums.numel(), lanes, lambda words, elements: _mean_from_words(
        word_sums[words], shifts, layout.lane_mask, layout.world_size, out[elements]))
    return out[:numel]


def bit_padding(layout: LaneLayout) -> int:
    """Elements past ``n`` that ``mean_from_lane_sums`` may write: less than one block of the blocked order."""
    return lane_block_values(layout.lanes_per_word)
