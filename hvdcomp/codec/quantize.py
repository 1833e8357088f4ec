"""Max-norm stochastic quantization whose integer levels can be summed across workers.

Pure tensor math, no collectives. One exchange of a W-worker reduction goes:

1. ``local_stats(x, groups)`` on every worker, reduced with **MAX** -> a shared scale ``M`` per group
   of elements (``scale_groups``: per tensor or per chunk) and a flag that some worker saw NaN/Inf;
2. (multi-scale only) ``agreement_words(x, scale_stats, groups)``, reduced with **SUM** -> ``agreed_resolutions``:
   per element the finest resolution that every worker can represent;
3. ``encode(x, scale_stats, groups, agreed)``, reduced with **SUM** -> ``decode(...)`` = mean over the
   workers of their dequantized values.

Each worker's level for an element ``x`` at resolution ``s`` is ``sign(x) * floor(|x| * (s / M) + U)``,
``U`` uniform on (0, 1) (16 bits, ``hvdcomp.codec.random``), so ``E[level] * M / s = x`` (unbiased, up to
``2**-17`` of a level from the draws' 16 bits) and the per-element variance is at most
``(M / s)**2 / 4``. ``M`` here is the shared maximum, or ``SCALE_FLOOR`` (2**-100) where that is smaller (an
all-zero or vanishingly small group), so ``s / M`` is finite and the levels stay unbiased. The per-element
factors (``s / M`` to encode, ``M / (s W)`` to decode) are computed once per group: the kernels multiply.
``U`` is element ``i``'s draw of the counter-based stream whose words the caller passes (seed, rank, key, step).

Steps 2 and 3 and the decode each run as one fused kernel (``hvdcomp.codec.fused``: scale, draw, round, sign, offset
and pack in one pass; unpack, offset and scale in another); the module-level functions below are their eager reference.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from . import native, native_stats
from .fused import FusedKernel
from .packing import (
    INT64_WORD_BITS,
    LANE_BLOCK_WORDS,
    LaneLayout,
    in_lane_blocks,
    lane_block_words,
    map_lane_blocks,
    pack_lane_blocks,
    pack_lanes,
)
from .pieces import Pieces
from .random import uniform
from .recycle import ResultBuffers
from .validate import check_bits, check_groups, check_int, check_stats

SCALE_FLOOR = 2.0**-100  # the smallest scale M rounding uses: s / M stays finite, M / (s W) normal for W <= 1024
_LOOP_MAX_GROUPS = 16
_LOOP_MIN_MEAN_LENGTH = 4096


def stochastic_levels(magnitude: torch.Tensor, sign_of: torch.Tensor, rng: torch.Tensor, limit: int,
                      first: int = 0) -> torch.Tensor:
    """int64 ``sign(sign_of) * min(floor(magnitude + U), limit)``, ``U`` = uniform ``first + i`` of the stream
    words ``rng`` (``hvdcomp.codec.random.stream_words``) for element ``i``: unbiased (up to ``2**-17``)
    for ``sign(sign_of) * magnitude`` (``0 <= magnitude <= limit <= 2**16``, float32), variance at most 1/4.
    Converted through int32 (exact at these sizes): AVX2 converts float32 to int32 in vectors, to int64 not."""
    noise = uniform(magnitude.numel(), rng.to(magnitude.device), first).view(magnitude.shape)
    levels = torch.floor(magnitude + noise).clamp(max=limit)
    return levels.copysign(sign_of.reshape(magnitude.shape).float()).to(torch.int32).to(torch.int64)


def _signed_levels(x: torch.Tensor, units: torch.Tensor, coarse: int, rng: torch.Tensor,
                   first: int = 0) -> torch.Tensor:
    """int64 ``sign(x) min(floor(|x| units + U), s_1)`` per element, ``U`` = uniform ``first + i`` of ``rng``."""
    return stochastic_levels(x.abs().float() * units, x, rng, coarse, first)


class MaxNormQuantizer:
    """Unbiased max-norm quantizer at one (``bits=(b,)``) or several (``bits=(b1 < b2 < ...)``) resolutions.

    Resolution ``j`` has ``s_j = 2**bits[j] - 1`` levels per sign. Every level travels in the range of
    the coarsest resolution ``[-s_1, s_1]``; with several resolutions an element uses the finest
    ``s_j`` for which ``r * s_j <= s_1`` holds on *every* worker (the seed's MIN rule), so fine
    resolutions serve the many small elements at the coarse resolution's wire cost.

    Args:
        bits: resolutions in bits per sign, strictly increasing, each in [1, 16].
        chunk_size: elements sharing one scale ``M``; ``None`` for one scale per tensor.
    """

    def __init__(self, bits: Sequence[int], chunk_size: int | None = None) -> None:
        self.bits = check_bits(bits)
        self.chunk_size = None if chunk_size is None else check_int("chunk_size", chunk_size, 1)
        self.levels = tuple(2**b - 1 for b in self.bits)
        self._scale_scratch: torch.Tensor | None = None  # reused by _scale_per_element

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_scale_scratch": None}

    @property
    def coarse_levels(self) -> int:
        return self.levels[0]

    @property
    def multiscale(self) -> bool:
        return len(self.levels) > 1

    def scale_groups(self, numel: int, segments: Sequence[int] | None = None) -> torch.Tensor:
        """int64 lengths of the runs of elements that share one scale ``M``.

        ``segments`` splits the ``numel`` elements into consecutive tensors (default: one tensor);
        each non-empty tensor gets one scale, or one per ``chunk_size`` elements of it.
        """
        segments = [numel] if segments is None else list(segments)
        if sum(segments) != numel or min(segments, default=0) < 0:
            raise ValueError(f"segments {segments[:8]}... do not split {numel} elements")
        lengths = []
        for length in segments:
            if self.chunk_size is None or length <= self.chunk_size:
                lengths.append(torch.tensor([length]) if length else torch.empty(0, dtype=torch.int64))
            else:
                full, rest = divmod(length, self.chunk_size)
                lengths.append(torch.full((full + (rest > 0),), self.chunk_size, dtype=torch.int64))
                if rest:
                    lengths[-1][-1] = rest
        return lengths[0] if len(lengths) == 1 else torch.cat(lengths or [torch.empty(0, dtype=torch.int64)])

    # -- step 1: shared scale --------------------------------------------------------------------
    def local_stats(self, x: torch.Tensor, groups: torch.Tensor,
                    finite: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[len(groups) + 1]``: max of finite ``|x|`` per scale group (see ``scale_groups``),
        then 1.0 if ``x`` has NaN/Inf, or, given ``finite`` (0-d bool: e.g. whether the whole gradient that
        ``x`` was selected from is finite, from ``sparse.gather``), 1.0 where ``finite`` is False. Reduce with MAX
        across workers. Where ``native.usable``: one pass of ``native_stats``; else few long groups (per-tensor
        scales) take one ``aminmax`` each, many short ones (chunks) or NaN/Inf the segmented reduction."""
        flat = x.detach().reshape(-1)
        check_groups(groups, flat.numel())
        if native.usable(flat):
            return native_stats.local_stats(flat, groups, finite)
        scale_stats = torch.zeros(groups.numel() + 1, dtype=torch.float32, device=x.device)
        if _few_long_groups(groups, flat.numel()):
            for group, (low, high) in enumerate(torch.aminmax(piece) for piece in flat.split(groups.tolist())):
                torch.maximum(-low, high, out=scale_stats[group]).abs_()  # -0.0 for zeros: 0.0, as the kernels
            if bool(torch.isfinite(scale_stats[:-1]).all()):  # else a group holds NaN/Inf: redo it exactly below
                if finite is not None:
                    scale_stats[-1] = (~finite).float()
                return scale_stats
        mags = flat.abs().float()
        nonfinite = ~(torch.isfinite(mags).all() if finite is None else finite)
        mags = torch.nan_to_num_(mags, nan=0.0, posinf=0.0)
        if groups.numel():  # unsafe: the lengths were checked above
            scale_stats[:-1] = torch.segment_reduce(mags, "max", lengths=groups.to(x.device), unsafe=True)
        scale_stats[-1] = nonfinite.float()
        return scale_stats

    @staticmethod
    def saw_nonfinite(scale_stats: torch.Tensor) -> bool:
        """Whether any worker's tensor held NaN/Inf, from the MAX-reduced ``local_stats``."""
        return bool(scale_stats[-1].item() > 0)

    def _per_element(self, per_group: torch.Tensor, groups: torch.Tensor, numel: int,
                     size: int | None = None) -> torch.Tensor:
        """float32 ``[size]`` (default ``numel``): ``per_group[g]`` for each element of group ``g``, and for the
        padding past ``numel`` 0 (or, for one group, a broadcast view of its value). Few long groups fill a
        scratch buffer of this quantizer: the result is valid until the next call."""
        size = numel if size is None else size
        if groups.numel() <= 1:
            return per_group.reshape(-1)[:1].expand(size) if groups.numel() else per_group.new_zeros(size)
        if not _few_long_groups(groups, numel):
            values = per_group.repeat_interleave(groups.to(per_group.device), output_size=numel)
            return torch.cat([values, values.new_zeros(size - numel)]) if size > numel else values
        scratch = self._scale_scratch
        if scratch is None or scratch.numel() < size or scratch.device != per_group.device:
            scratch = self._scale_scratch = torch.empty(size, dtype=torch.float32, device=per_group.device)
        out = scratch[:size]
        for piece, value in zip(out[:numel].split(groups.tolist()), per_group):
            piece.fill_(value)
        out[numel:].zero_()
        return out

    @staticmethod
    def _scales(scale_stats: torch.Tensor) -> torch.Tensor:
        """float32 per group: the scale ``M`` rounding uses, the MAX-reduced maximum or ``SCALE_FLOOR``."""
        return scale_stats[:-1].clamp(min=SCALE_FLOOR)

    def _encode_units(self, scale_stats: torch.Tensor, groups: torch.Tensor, agreed: torch.Tensor | None,
                      numel: int) -> torch.Tensor:
        """float32 ``[numel]``: the factor to levels, ``s / M`` per element (``s`` the agreed resolution's)."""
        if agreed is None:
            if self.multiscale:
                raise ValueError("multi-scale encode/decode needs the agreed resolutions")
            return self._per_element(self.group_units(scale_stats), groups, numel)
        inverse = self._per_element(1.0 / self._scales(scale_stats), groups, numel)
        return _times_levels(inverse, agreed, self.levels)

    def _decode_units(self, scale_stats: torch.Tensor, groups: torch.Tensor, agreed: torch.Tensor | None, numel: int,
                      world_size: int, size: int) -> torch.Tensor:
        """float32 ``[size]``: the factor from summed levels to the mean, ``M / (s W)`` per element (0 past
        ``numel``)."""
        if agreed is None:
            if self.multiscale:
                raise ValueError("multi-scale encode/decode needs the agreed resolutions")
            return self._per_element(self._scales(scale_stats) / float(self.coarse_levels * world_size), groups, numel,
                                     size)
        units = self._per_element(self._scales(scale_stats) / float(world_size), groups, numel, size).contiguous()
        _divide_by_levels(units[:numel], agreed, self.levels)  # in place (a scratch buffer or a fresh one)
        return units

    # -- step 2: agreement on the resolution (multi-scale only) -----------------------------------
    def agreement_layout(self, world_size: int, word_bits: int = INT64_WORD_BITS) -> LaneLayout:
        """One 0/1 lane per element and finer resolution, counted over the workers."""
        return LaneLayout(span=1, world_size=world_size, word_bits=word_bits)

    def agreement_words(
        self,
        x: torch.Tensor,
        scale_stats: torch.Tensor,
        groups: torch.Tensor,
        world_size: int,
        word_bits: int = INT64_WORD_BITS,
    ) -> torch.Tensor:
        """int64 words of "resolution j fits" bits for j = 2..L (element-major per j). Reduce with SUM."""
        if not self.multiscale:
            raise RuntimeError("agreement is only needed with several resolutions")
        inverse = self._per_element(1.0 / self._scales(scale_stats), groups, x.numel())
        shifts = self.agreement_layout(world_size, word_bits).lane_shifts(x.device)
        return _agreement_words(x.reshape(-1), inverse, self.levels, shifts)

    def agreed_resolutions(
        self, word_sums: torch.Tensor, numel: int, world_size: int, word_bits: int = INT64_WORD_BITS
    ) -> torch.Tensor:
        """float32 ``[numel]``: index of the finest resolution every worker can represent (integer values;
        float32 because Inductor writes it several times faster than int64)."""
        layout = self.agreement_layout(world_size, word_bits)
        if word_sums.numel() != layout.num_words(numel * (len(self.levels) - 1)):
            raise ValueError(f"{word_sums.numel()} agreement words do not fit {numel} elements")
        fits = _all_fit(word_sums, layout.lane_shifts(word_sums.device), layout.lane_mask, world_size)
        counts = fits[:numel]
        for j in range(1, len(self.levels) - 1):  # over the finer resolutions (a sum over dim 0 is slower)
            counts = counts + fits[j * numel:(j + 1) * numel]
        return counts

    # -- step 3: the summed payload ---------------------------------------------------------------
    def payload_layout(self, world_size: int, word_bits: int = INT64_WORD_BITS) -> LaneLayout:
        return LaneLayout.for_levels(self.coarse_levels, world_size, word_bits)

    def maxima(self, scale_stats: torch.Tensor, groups: torch.Tensor, numel: int) -> torch.Tensor:
        """float32 ``[numel]``: each element's shared maximum as reduced (0 for an all-zero group; not floored
        at ``SCALE_FLOOR``); valid until the quantizer's next per-element call."""
        return self._per_element(scale_stats[:-1], groups, numel)

    def group_steps(self, scale_stats: torch.Tensor) -> torch.Tensor:
        """float32 per scale group: ``M / s``, one level's worth (single resolution)."""
        return self._scales(scale_stats) / float(self.coarse_levels)

    def group_units(self, scale_stats: torch.Tensor) -> torch.Tensor:
        """float32 per scale group: ``s / M``, the factor from values to levels (single resolution)."""
        return self._scales(scale_stats).reciprocal_().mul_(float(self.coarse_levels))  # float / tensor's own ops

    def step_sizes(self, scale_stats: torch.Tensor, groups: torch.Tensor, numel: int) -> torch.Tensor:
        """float32 ``[numel]``: ``group_steps`` per element (a new tensor)."""
        return self._per_element(self._scales(scale_stats), groups, numel) / float(self.coarse_levels)

    def quantize_levels(self, x: torch.Tensor, scale_stats: torch.Tensor, groups: torch.Tensor,
                        agreed: torch.Tensor | None, rng: torch.Tensor) -> torch.Tensor:
        """int64 ``[numel]``: this worker's signed levels in ``[-s_1, s_1]`` (finite ``x`` only), rounded with
        the stream words ``rng`` as ``encode`` rounds them (unpacked: for exchanges that pack differently)."""
        units = self._encode_units(scale_stats, groups, agreed, x.numel())
        return _signed_levels(x.reshape(-1), units, self.coarse_levels, rng.to(x.device))

    def encode(self, x: torch.Tensor | Pieces, scale_stats: torch.Tensor, groups: torch.Tensor,
               agreed: torch.Tensor | None, world_size: int, word_bits: int = INT64_WORD_BITS,
               rng: torch.Tensor | None = None, out: torch.Tensor | None = None,
               local_out: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``[packing.lane_block_words(numel, L)]`` words of this worker's signed levels (finite ``x`` only)
        in ``payload_layout``'s lanes, in the blocked order (``packing.pack_lane_blocks``). Reduce with SUM.

        ``rng``: the int64 ``[4]`` stream words of ``hvdcomp.codec.random.stream_words`` (required);
        element ``i`` rounds with the stream's uniform ``i``. With ``out`` (contiguous, that size: int64, or float64
        for a float carrier) the words go there and it is returned (native kernels write it, others copy). ``local_out``
        (float32 ``[len(groups) + 1]``) receives ``local_stats(x, groups)``: natively in the encode's pass. ``x`` may be
        ``Pieces`` (``hvdcomp.codec.pieces``) where the native kernels run, at one resolution without ``agreed``."""
        if rng is None:
            raise ValueError("encode needs the rounding stream's words (hvdcomp.codec.random.stream_words)")
        if isinstance(x, Pieces) and (agreed is not None or self.multiscale):
            raise ValueError("pieces are encoded natively: at one resolution, without agreed resolutions")
        x = x if isinstance(x, Pieces) else x.reshape(-1)  # (a copy where x is not contiguous, which the kernels take)
        layout, coarse = self.payload_layout(world_size, word_bits), self.coarse_levels
        check_stats(scale_stats, groups, x.numel if isinstance(x, Pieces) else x.numel())
        if isinstance(x, Pieces) or (agreed is None and not self.multiscale and native.usable(x)):
            return native.encode(x, groups, self.group_units(scale_stats), coarse, layout.lanes_per_word,
                                 layout.lane_width, rng, out, local_out)
        rng = rng.to(x.device)
        if local_out is not None:
            local_out.copy_(self.local_stats(x, groups))
        units = self._encode_units(scale_stats, groups, agreed, x.numel())
        shifts = layout.lane_shifts(x.device)
        words = in_lane_blocks(x.numel(), shifts,
                               lambda end, block_out: _encode_blocks(x[:end], units[:end], coarse, shifts, rng,
                                                                     block_out),
                               lambda end: _tail_levels(x[end:], units[end:], coarse, rng, end))
        return words if out is None else out.copy_(words)

    def decode(
        self,
        word_sums: torch.Tensor,
        scale_stats: torch.Tensor,
        groups: torch.Tensor,
        agreed: torch.Tensor | None,
        numel: int,
        world_size: int,
        word_bits: int = INT64_WORD_BITS,
        buffers: ResultBuffers | None = None,
        key: Hashable = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 ``[numel]``: the mean over the workers of their dequantized values from the sums of their
        ``encode`` words (a view of a buffer padded to whole blocks; with ``buffers``, where the native kernels run,
        ``key``'s buffer there, reused once nothing refers to it; with ``out``, float32 ``[numel]``: that one)."""
        layout = self.payload_layout(world_size, word_bits)
        if word_sums.dtype != torch.int64 or word_sums.numel() != lane_block_words(numel, layout.lanes_per_word) or (
                out is not None and out.shape != (numel,)):
            raise ValueError(f"{word_sums.numel()} {word_sums.dtype} words (or out) cannot hold {numel} levels here")
        check_stats(scale_stats, groups, numel)
        size = word_sums.numel() * layout.lanes_per_word
        if agreed is None and not self.multiscale and native.usable(word_sums, torch.int64):
            factors = self._scales(scale_stats) / float(self.coarse_levels * world_size)
            means = out if out is not None or buffers is None else buffers.take(key, size, torch.float32,
                                                                                   word_sums.device)
            return native.decode(word_sums, groups, factors, layout.lanes_per_word, layout.lane_width,
                                 layout.offset * world_size, means, None if out is None else numel)[:numel]
        units = self._decode_units(scale_stats, groups, agreed, numel, world_size, size)
        means = _decode_mean(word_sums, layout.lane_shifts(word_sums.device), layout.lane_mask,
                             layout.offset * world_size, units)
        return means[:numel] if out is None else out.copy_(means[:numel])


def _few_long_groups(groups: torch.Tensor, numel: int) -> bool:
    """Whether a Python loop over the scale groups (one small op each) beats a segmented kernel: few
    groups, or groups long enough on average (per-tensor scales, not chunks)."""
    return groups.numel() <= _LOOP_MAX_GROUPS or numel >= _LOOP_MIN_MEAN_LENGTH * groups.numel()


def _agreement_words_eager(x: torch.Tensor, inverse: torch.Tensor, levels: tuple[int, ...],
                           shifts: torch.Tensor) -> torch.Tensor:
    """Words of the bits ``|x| / M * s_j <= s_1`` for each finer ``s_j`` (j-major), one bit per lane
    (``inverse``: ``1 / M`` per element; ``levels``: ``s_1 < s_2 < ...``)."""
    ratio = x.abs().float() * inverse
    fits = [ratio * float(level) <= levels[0] for level in levels[1:]]
    return pack_lanes(fits[0] if len(fits) == 1 else torch.cat(fits), shifts)


def _all_fit_eager(word_sums: torch.Tensor, shifts: torch.Tensor, mask: int, world_size: int) -> torch.Tensor:
    """float32 ``[words * L]``: 1.0 where every worker's bit is set, for every lane of every word (the padding
    included: ``agreed_resolutions`` cuts it off outside the kernel, which keeps the loop over whole words)."""
    lanes = word_sums.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(mask)
    return (lanes == world_size).to(torch.float32).view(-1)


def _resolution_levels(agreed: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """float32 ``s_j`` per element for the agreed resolution index ``j`` (a sum of steps: exact, no gather)."""
    result = torch.full_like(agreed, float(levels[0]), dtype=torch.float32)
    for j in range(1, len(levels)):
        result = result + (agreed >= j).float() * float(levels[j] - levels[j - 1])
    return result


def _times_levels_eager(inverse: torch.Tensor, agreed: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """float32 ``inverse * s_j`` per element (the encode factor ``s_j / M``)."""
    return inverse * _resolution_levels(agreed, levels)


def _divide_by_levels_eager(units: torch.Tensor, agreed: torch.Tensor, levels: tuple[int, ...]) -> None:
    """``units /= s_j`` per element, in place (the decode factor ``M / (s_j W)``)."""
    units.div_(_resolution_levels(agreed, levels))


def _encode_blocks_eager(x: torch.Tensor, units: torch.Tensor, coarse: int, shifts: torch.Tensor,
                         rng: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` <- the words (blocked order, whole blocks) of ``_signed_levels(x, units, coarse, rng) + s_1`` per
    element."""
    out.copy_(pack_lane_blocks(_signed_levels(x, units, coarse, rng) + coarse, shifts))


def _tail_levels_eager(x: torch.Tensor, units: torch.Tensor, coarse: int, rng: torch.Tensor,
                       first: int) -> torch.Tensor:
    """``_signed_levels(x, units, coarse, rng, first) + s_1``: the lane values of a last, partial block."""
    return _signed_levels(x, units, coarse, rng, first) + coarse


def _decode_mean_eager(word_sums: torch.Tensor, shifts: torch.Tensor, mask: int, offset: int,
                       units: torch.Tensor) -> torch.Tensor:
    """float32 ``[words * L]``: ``(sum of levels) * units`` for every lane of whole blocks of words in the
    blocked order (``units``: ``M / (s W)`` per element, 0 for the padding)."""
    per_lane = units.view(-1, shifts.numel(), LANE_BLOCK_WORDS)
    return map_lane_blocks(word_sums, shifts, mask, lambda sums, lanes: (sums - offset).float() * per_lane[:, lanes])


_agreement_words = FusedKernel(_agreement_words_eager)
_all_fit = FusedKernel(_all_fit_eager)
_times_levels = FusedKernel(_times_levels_eager)
_divide_by_levels = FusedKernel(_divide_by_levels_eager, in_place=True)
_encode_blocks = FusedKernel(_encode_blocks_eager, in_place=True)
_tail_levels = FusedKernel(_tail_levels_eager)  # its Philox rounds cost about 0.4 ms per bucket eagerly
_decode_mean = FusedKernel(_decode_mean_eager)
