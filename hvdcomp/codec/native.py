"""Hand-written CPU kernels for the single-resolution max-norm codec and Birder: ``native_kernels.cpp``, through ctypes.

QSGD's encode (Philox draw, stochastic rounding, sign, offset, lane packing) and decode (unpack, offset, scale),
Birder's moments update and draw (into lane words or bools), its mean from +1 counts, its re-binarization and bit
packing, unpacking and counting for the two-stage and hierarchical routes, each one pass over the bucket, a few
thousand values at a time through stack buffers, QSGD's per-element factor read from per-group factors (no
gradient-sized buffer besides the result); Birder's per-parameter passes are in ``native_birder``, bit planes in
``native_planes``, 16-bit means in ``native_half``, a float carrier's sums in ``native_carrier``. They compute exactly
what the eager reference computes (``hvdcomp.codec.quantize``, ``hvdcomp.codec.onebit``; ``tests/test_native.py``).

**Sizes.** Every wrapper below checks the device, dtype, contiguity and size of each tensor it hands the kernels
(O(1) checks, before the ctypes call) and raises ``ValueError`` otherwise; each kernel also refuses sizes that cannot
be right (a nonzero status, raised as ``ValueError`` too) and reads and writes only within the sizes it is given.

**Build.** ``native_build`` compiles and loads the library at first use, from a private per-user cache only (its
docstring); a compile or load failure falls back like any fused kernel (``fused.fail``: one warning, then eager).

**When.** On CPU tensors, while fused kernels are enabled (``HVDCOMP_FUSED``, ``fused.eager()``), unless
``HVDCOMP_NATIVE=0``; elsewhere (GPU: Triton) the ``torch.compile`` kernels run. Work splits over the torch threads
in whole lane blocks (ctypes releases the GIL during the calls) on a pool that a forked child replaces.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from . import fused
from .cache import CACHE_ENV as CACHE_ENV
from .native_build import FLAGS as FLAGS
from .native_build import build as build
from .native_build import compiler as compiler
from .native_build import declare as declare
from .native_build import library_path as library_path
from .native_build import load
from .packing import LANE_BLOCK_WORDS, lane_block_values, lane_block_words
from .pieces import Pieces
from .random import OUTPUTS_PER_BLOCK
from .validate import check_groups, group_total

ENV_SWITCH = "HVDCOMP_NATIVE"
MIN_VALUES_PER_THREAD = 1 << 16  # below this a thread's start costs more than its share


class _Library:
    handle: ctypes.CDLL | None = None
    tried = False
    pool: ThreadPoolExecutor | None = None
    pool_threads = 0
    lock = threading.Lock()  # guards the lazy load and the pool


def _after_fork_in_child() -> None:
    """A forked child inherits the pool without its threads: forget it (and the lock, which may be held)."""
    _Library.pool, _Library.pool_threads, _Library.lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built at the first call; None if building or loading failed (``fused.fail`` warned)."""
    with _Library.lock:
        if not _Library.tried:
            _Library.tried = True
            try:
                _Library.handle = load()
            except Exception as error:  # noqa: BLE001 (no compiler, a failed build, an unloadable file)
                fused.fail(error, stacklevel=4)
    return _Library.handle


def usable(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels take ``x``: a contiguous CPU tensor of ``dtype``, fused kernels on, the switch not off,
    and the library built."""
    return (x.device.type == "cpu" and x.dtype == dtype and x.is_contiguous() and fused.enabled()
            and os.environ.get(ENV_SWITCH, "1") != "0" and library() is not None)


def usable_each(tensors: Sequence[torch.Tensor | None], dtype: torch.dtype = torch.float32) -> list[bool]:
    """``usable`` of each of ``tensors`` (None: False), the switches read once."""
    if not tensors or not usable(torch.empty(0, dtype=dtype)):
        return [False] * len(tensors)
    return [t is not None and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors]


def _in_parallel(run: Callable[[int, int], Any], values: int, per_block: int) -> list[Any]:
    """``run(first, last)`` over ``[0, values)`` (whole blocks of ``per_block``), split over the torch threads; returns
    what each call returned."""
    threads = max(1, min(torch.get_num_threads(), values // MIN_VALUES_PER_THREAD))
    if threads == 1:
        return [run(0, values)]
    with _Library.lock:
        if _Library.pool is None or _Library.pool_threads < threads - 1:
            if _Library.pool is not None:  # a smaller pool: its threads end once their work is done
                _Library.pool.shutdown(wait=False)
            _Library.pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="hvdcomp-native")
            _Library.pool_threads = threads - 1
        blocks = values // per_block
        bounds = [blocks * t // threads * per_block for t in range(threads + 1)]
        pending = [_Library.pool.submit(run, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    return [run(bounds[0], bounds[1])] + [future.result() for future in pending]


def _checked(name: str, tensor: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    """``tensor``, checked to be a contiguous CPU tensor of ``dtype`` (of ``numel`` elements if given)."""
    if not (tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous()):
        raise ValueError(f"the kernels take {name} as a contiguous {dtype} CPU tensor, not {tensor.dtype} on "
                         f"{tensor.device} (contiguous: {tensor.is_contiguous()})")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"the kernels take {name} of {numel} elements, not {tensor.numel()}")
    return tensor


def _stream(rng: torch.Tensor) -> torch.Tensor:
    """The rounding stream's words as contiguous int64 ``[4]`` on the CPU (``random.stream_words``), checked."""
    return _checked("the stream words", rng.to(torch.int64).contiguous(), torch.int64, 4)


def _check_lanes(lanes: int, width: int, word_bits: int = 64) -> None:  # 52 for float64 words
    if not (lanes >= 1 and width >= 1 and lanes * width <= word_bits):
        raise ValueError(f"{lanes} lanes of {width} bits do not fit a {word_bits}-bit word")


def _groups(groups: torch.Tensor, factors: torch.Tensor,
            numel: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """int64 cumulative group ends and float32 per-group factors, contiguous on the CPU, and the groups' elements,
    checked: one factor per group, the groups splitting ``numel`` values (any number: None)."""
    lengths, factors = groups.to("cpu", torch.int64), factors.to("cpu", torch.float32).contiguous()
    total = group_total(lengths, numel)
    if factors.shape != lengths.shape:
        raise ValueError(f"{factors.numel()} scale factors for {groups.numel()} scale groups")
    return (lengths if lengths.numel() <= 1 else lengths.cumsum(0)), factors, total


def uniform(numel: int, rng: torch.Tensor, first: int = 0) -> torch.Tensor:
    """``random.uniform(numel, rng, first)`` (float32 ``[numel]``) from the kernels' own Philox draws (``usable``
    decides when; any ``first >= 0``)."""
    skip = first % OUTPUTS_PER_BLOCK
    blocks = -(-(skip + numel) // OUTPUTS_PER_BLOCK)
    draws = torch.empty(blocks * OUTPUTS_PER_BLOCK, dtype=torch.float32)
    words = _stream(rng)  # alive through the call
    _Library.handle.hvdcomp_uniform(words.data_ptr(), first - skip, draws.numel(), draws.data_ptr())
    return draws[skip:skip + numel]


def _output(out: torch.Tensor | None, size: int, dtype: torch.dtype) -> torch.Tensor:
    """``out``, checked to be a contiguous CPU ``[size]`` tensor of ``dtype``, or a new one if None."""
    if out is not None and not (out.shape == (size,) and out.dtype == dtype and out.is_contiguous()
                                and out.device.type == "cpu"):
        raise ValueError(f"the kernel writes a contiguous {dtype} [{size}] CPU tensor, not {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    return torch.empty(size, dtype=dtype) if out is None else out


def encode(x: torch.Tensor | Pieces, groups: torch.Tensor, factors: torch.Tensor, coarse: int, lanes: int, width: int,
           rng: torch.Tensor, out: torch.Tensor | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[lane_block_words(numel, lanes)]`` (into ``out`` if given; a float64 ``out``, for a float carrier, gets
    each word's value as float64: ``lanes * width <= 52``): ``quantize``'s encode words of flat float32 ``x``
    (``usable``; or its ``Pieces``), ``factors[g]`` = ``s / M`` of group ``g`` (int64 ``groups``: lengths), ``rng``
    the stream words; ``stats`` (float32 ``[G + 1]``) if given <- ``quantize.local_stats(x, groups)``, same pass."""
    float_words = out is not None and out.dtype == torch.float64
    _check_lanes(lanes, width, 52 if float_words else 64)
    x = Pieces.of(x)
    ends, factors, _ = _groups(groups, factors, x.numel)
    rng = _stream(rng)
    out = _output(out, lane_block_words(x.numel, lanes), torch.float64 if float_words else torch.int64)
    stats = None if stats is None else _output(stats, ends.numel() + 1, torch.float32)

    def run(first: int, last: int) -> torch.Tensor | None:  # this range's statistics, zeroed first (all: stats)
        part = None if stats is None else stats if last - first == out.numel() * lanes else torch.empty_like(stats)
        _Library.handle.hvdcomp_encode(*x.arguments(), ends.data_ptr(), factors.data_ptr(), ends.numel(), coarse,
                                       lanes, width, rng.data_ptr(), first, last, out.data_ptr(),
                                       None if part is None else part.zero_().data_ptr(), int(float_words))
        return part

    partials = _in_parallel(run, out.numel() * lanes, lane_block_values(lanes))
    if stats is not None and len(partials) > 1:
        torch.amax(torch.stack(partials), dim=0, out=stats)
    return out


def decode(word_sums: torch.Tensor, groups: torch.Tensor, factors: torch.Tensor, lanes: int, width: int,
           offset: int, means: torch.Tensor | None = None, numel: int | None = None) -> torch.Tensor:
    """float32 ``[numel]`` (default ``words * lanes``; into ``means`` if given: contiguous, that size): ``(lane -
    offset) * factors[g]`` per value of the int64 blocked-order ``word_sums`` (whole lane blocks), 0 past the groups;
    ``factors[g]`` = ``M / (s W)`` of group ``g``."""
    _check_lanes(lanes, width)
    word_sums = _checked("the word sums", word_sums.contiguous(), torch.int64)
    if word_sums.numel() % LANE_BLOCK_WORDS:
        raise ValueError(f"{word_sums.numel()} words are not whole lane blocks")
    ends, factors, grouped = _groups(groups, factors, None)
    size = word_sums.numel() * lanes
    if grouped > size or not 0 <= (numel if numel is not None else size) <= size:
        raise ValueError(f"{word_sums.numel()} words of {lanes} lanes hold neither {numel} means nor these groups")
    means = _output(means, size if numel is None else numel, torch.float32)

    def run(first: int, last: int) -> None:
        _Library.handle.hvdcomp_decode(word_sums.data_ptr(), ends.data_ptr(), factors.data_ptr(), ends.numel(), lanes,
                                       width, offset, first, last, means.numel(), means.data_ptr())

    _in_parallel(run, size, lane_block_values(lanes))
    return means


def _moment_args(m: torch.Tensor, b: torch.Tensor, grad: torch.Tensor | None,
                 runs: Sequence[tuple[int, int, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient (``m`` itself where there are no runs: not read), the run bounds (int64 ``[2 R]``) and their
    ``beta, 1 - beta`` (float32 ``[2 R]``) for the kernels that update Birder's moments, checked (``b`` too)."""
    numel = _checked("m", m, torch.float32).numel()
    _checked("b", b, torch.float32, numel)
    edges = [edge for lo, hi, _ in runs for edge in (lo, hi)]
    if edges != sorted(edges) or (edges and (edges[0] < 0 or edges[-1] > numel)):
        raise ValueError(f"moment runs must be ascending, disjoint spans of [0, {numel}), got {list(runs)}")
    if runs and (grad is None or grad.shape != m.shape):
        shape = None if grad is None else tuple(grad.shape)
        raise ValueError(f"updating the moments needs a gradient of {numel} elements, got {shape}")
    if runs:
        _checked("the gradient", grad, torch.float32, numel)
    bounds = torch.tensor(edges, dtype=torch.int64)
    betas = torch.tensor([value for _, _, beta in runs for value in (beta, 1.0 - beta)], dtype=torch.float32)
    return (grad if runs else m), bounds, betas


def _whole_blocks(numel: int) -> int:
    """``numel`` rounded up to whole Philox blocks (what ``_in_parallel`` splits; the kernels stop at ``numel``)."""
    return -(-numel // OUTPUTS_PER_BLOCK) * OUTPUTS_PER_BLOCK


def _check_first(first: int) -> None:
    if first % OUTPUTS_PER_BLOCK:
        raise ValueError(f"the draw must start at a whole Philox block, not at uniform {first}")


def draw_bit_words(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, lanes: int, width: int, first: int,
                   grad: torch.Tensor | None = None, runs: Sequence[tuple[int, int, float]] = ()) -> torch.Tensor:
    """int64 ``[lane_block_words(n, lanes)]``: ``onebit.draw_lane_words`` of flat float32 ``m``, ``b`` (``usable``;
    ``first``, the draw's first uniform, a multiple of 8), after updating the moments over ``runs`` (ascending,
    disjoint ``[lo, hi)`` spans of ``[0, n)`` with their beta) from ``grad`` (``usable``), in the same pass."""
    _check_first(first)
    _check_lanes(lanes, width)
    rng = _stream(rng)
    numel = m.numel()
    grad, bounds, betas = _moment_args(m, b, grad, runs)
    out = torch.empty(lane_block_words(numel, lanes), dtype=torch.int64)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_draw_bits(m.data_ptr(), b.data_ptr(), grad.data_ptr(), numel, bounds.data_ptr(), betas.data_ptr(),
                              len(runs), lanes, width, rng.data_ptr(), first, lo, hi, out.data_ptr())

    _in_parallel(run, out.numel() * lanes, lane_block_values(lanes))
    return out


def draw_bools(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None = None,
               runs: Sequence[tuple[int, int, float]] = ()) -> torch.Tensor:
    """``out`` (contiguous bool ``[n]``, CPU) <- ``onebit.draw_bits`` of flat float32 ``m``, ``b`` (``usable``), from
    uniforms ``0 .. n - 1`` of ``rng``, after updating the moments over ``runs`` (as ``draw_bit_words``)."""
    numel = m.numel()
    out = _output(out, numel, torch.bool)
    rng = _stream(rng)
    grad, bounds, betas = _moment_args(m, b, grad, runs)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_draw_bools(m.data_ptr(), b.data_ptr(), grad.data_ptr(), numel, bounds.data_ptr(),
                               betas.data_ptr(), len(runs), rng.data_ptr(), 0, lo, min(hi, numel), out.data_ptr())

    _in_parallel(run, _whole_blocks(numel), OUTPUTS_PER_BLOCK)
    return out


def binarize_counts(counts: torch.Tensor, group: int, length: int, rng: torch.Tensor, first: int) -> torch.Tensor:
    """bool ``[length]``: ``onebit.binarize_counts`` of contiguous int64 ``counts`` (CPU; ``first`` a multiple of 8)."""
    _check_first(first)
    _checked("the counts", counts, torch.int64)
    if counts.numel() > length:
        raise ValueError(f"{counts.numel()} counts do not fit {length} bits")
    rng = _stream(rng)
    out = torch.empty(length, dtype=torch.bool)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_binarize_counts(counts.data_ptr(), counts.numel(), group, rng.data_ptr(), first, lo,
                                    min(hi, length), out.data_ptr())

    _in_parallel(run, _whole_blocks(length), OUTPUTS_PER_BLOCK)
    return out


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, ceil(n / 8)]``: ``packing.bits_to_bytes`` of contiguous bool ``[rows, n]`` (CPU)."""
    rows, numel = _checked("the bits", bits, torch.bool).shape
    out = torch.empty(rows, -(-numel // 8), dtype=torch.uint8)
    _Library.handle.hvdcomp_pack_bits(bits.data_ptr(), rows, numel, out.data_ptr())
    return out


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """bool ``[rows, numel]``: ``packing.bytes_to_bits`` of contiguous uint8 ``[rows, bytes]`` (CPU)."""
    rows, size = _packed_rows(packed, numel)
    out = torch.empty(rows, numel, dtype=torch.bool)
    _Library.handle.hvdcomp_unpack_bits(packed.data_ptr(), rows, size, numel, out.data_ptr())
    return out


def _packed_rows(packed: torch.Tensor, numel: int) -> tuple[int, int]:
    """(rows, bytes) of contiguous uint8 ``[rows, bytes]`` ``packed`` (CPU), checked to hold ``numel`` bits a row."""
    rows, size = _checked("the packed bits", packed, torch.uint8).shape
    if not 0 <= numel <= size * 8:
        raise ValueError(f"rows of {size} bytes do not hold {numel} bits")
    return rows, size


def _lane_words(words: torch.Tensor, numel: int, lanes: int, width: int) -> torch.Tensor:
    """Contiguous int64 ``words`` (CPU), checked to hold ``numel`` values of ``lanes`` consecutive lanes."""
    _check_lanes(lanes, width)
    _checked("the lane words", words, torch.int64)
    if not 0 <= numel <= words.numel() * lanes:
        raise ValueError(f"{words.numel()} words of {lanes} lanes do not hold {numel} values")
    return words


def pack_lanes(values: torch.Tensor, lanes: int, width: int) -> torch.Tensor:
    """int64 ``[ceil(n / lanes)]``: contiguous int64 ``values`` ``[n]`` (CPU; in ``[0, 2**width)``) in consecutive
    lanes (``packing.LaneLayout.pack`` without an offset)."""
    _check_lanes(lanes, width)
    _checked("the lane values", values, torch.int64)
    words = torch.empty(-(-values.numel() // lanes), dtype=torch.int64)
    _Library.handle.hvdcomp_pack_lanes(values.data_ptr(), values.numel(), lanes, width, words.data_ptr())
    return words


def unpack_lanes(words: torch.Tensor, numel: int, lanes: int, width: int) -> torch.Tensor:
    """int64 ``[numel]``: the first ``numel`` lane values of contiguous int64 ``words`` (CPU) of consecutive lanes."""
    _lane_words(words, numel, lanes, width)
    values = torch.empty(numel, dtype=torch.int64)
    _Library.handle.hvdcomp_unpack_lanes(words.data_ptr(), numel, lanes, width, values.data_ptr())
    return values


def lane_counts_mean(words: torch.Tensor, numel: int, lanes: int, width: int, group: int,
                     out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous float32 ``[numel]``, CPU) <- ``(2 c - group) / group`` of the first ``numel`` counts ``c``
    in contiguous int64 ``words`` (CPU) of consecutive lanes; returns ``out``."""
    _lane_words(words, numel, lanes, width)
    out = _output(out, numel, torch.float32)
    _Library.handle.hvdcomp_lane_counts_mean(words.data_ptr(), numel, lanes, width, group, out.data_ptr())
    return out


def count_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """int64 ``[numel]``: per bit, how many rows of contiguous uint8 ``[rows, bytes]`` (CPU) have it set."""
    rows, size = _packed_rows(packed, numel)
    counts = torch.empty(numel, dtype=torch.int64)
    _Library.handle.hvdcomp_count_bits(packed.data_ptr(), rows, size, numel, counts.data_ptr())
    return counts


def counts_mean(word_sums: torch.Tensor, lanes: int, width: int, group: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous float32 ``[words * lanes]``, CPU) <- ``(2 count - group) / group`` for every lane of the
    int64 blocked-order ``word_sums`` (whole lane blocks) of +1 counts; returns ``out``."""
    _check_lanes(lanes, width)
    word_sums = _checked("the word sums", word_sums.contiguous(), torch.int64)
    if word_sums.numel() % LANE_BLOCK_WORDS:
        raise ValueError(f"{word_sums.numel()} words are not whole lane blocks")
    out = _output(out, word_sums.numel() * lanes, torch.float32)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_counts_mean(word_sums.data_ptr(), lanes, width, group, lo, hi, out.data_ptr())

    _in_parallel(run, out.numel(), lane_block_values(lanes))
    return out


def rotate(values: torch.Tensor, groups: torch.Tensor, max_block: int, rng: torch.Tensor,
           inverse: bool) -> torch.Tensor:
    """``values`` (contiguous float32, CPU) rotated in place, or rotated back with ``inverse``: ``rotation``'s
    randomized Hadamard transform in the blocks (at most ``max_block``) of the scale groups ``groups`` (int64
    lengths), the signs from the stream words ``rng``; returns ``values``."""
    numel = _checked("the values", values, torch.float32).numel()
    check_groups(groups, numel)
    ends = groups.to("cpu", torch.int64).cumsum(0).contiguous()
    rng = _stream(rng)
    lib = _Library.handle

    def run(first: int, last: int) -> None:
        lib.hvdcomp_rotate(values.data_ptr(), numel, ends.data_ptr(), ends.numel(), max_block, rng.data_ptr(),
                           int(inverse), first, last)

    _in_parallel(run, numel, 1)
    return values
