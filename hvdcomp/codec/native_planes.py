"""The native kernels of the two-stage exchange's bit-plane messages (``hvdcomp.exchange.two_stage``), through ctypes.

Stage one's rows (quantize, offset, bit planes, in one pass), the chunk owner's sum of the rows and its
re-quantization, and the decode of the gathered rows: each computes what the eager steps of ``two_stage`` compute,
bit for bit (``tests/test_two_stage.py``), without their level-sized temporaries. Use them where ``native.usable``
says; every wrapper checks the sizes it hands the kernels (``native``'s docstring).
"""

from __future__ import annotations

import torch

from .native import OUTPUTS_PER_BLOCK, _checked, _groups, _in_parallel, _Library, _output, _stream, _whole_blocks
from .packing import plane_bytes
from .pieces import Pieces

MAX_PLANE_WIDTH = 24  # native_kernels.cpp's kMaxPlaneWidth


def _plane_rows(name: str, rows: torch.Tensor, header: int, numel: int, width: int) -> tuple[int, int]:
    """(rows, bytes) of contiguous uint8 ``[rows, bytes]`` ``rows`` (CPU), checked to hold ``header`` bytes and then
    ``width`` bit planes of ``numel`` values a row."""
    if rows.dim() != 2:
        raise ValueError(f"the kernels take {name} as uint8 [rows, bytes], not {tuple(rows.shape)}")
    count, size = _checked(name, rows, torch.uint8).shape
    if not (0 <= header and 1 <= width <= MAX_PLANE_WIDTH and size >= header + plane_bytes(numel, width)):
        raise ValueError(f"rows of {size} bytes do not hold {header} header bytes and {width} planes of {numel} "
                         "values")
    return count, size


def encode_planes(x: torch.Tensor | Pieces, groups: torch.Tensor, factors: torch.Tensor, coarse: int, width: int,
                  rng: torch.Tensor, chunk: int, out: torch.Tensor, header: int,
                  stats: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (contiguous uint8 ``[rows, bytes]``, CPU; ``rows * chunk >= numel``) <- after each row's first
    ``header`` bytes, the ``width`` bit planes (``packing.pack_planes``) of row ``r``'s levels: ``quantize_levels``
    of flat float32 ``x`` (``usable``; or its ``Pieces``) for elements ``r chunk ..`` plus ``coarse`` (``coarse`` past
    ``numel``); ``factors[g]`` = ``s / M`` of group ``g``, ``rng`` the stream words; ``stats`` (float32
    ``[len(groups) + 1]``) if given <- ``quantize.local_stats(x, groups)``, same pass. Returns ``out``."""
    x = Pieces.of(x)
    numel = x.numel
    rows, size = _plane_rows("the stage-one rows", out, header, chunk, width)
    if rows * chunk < numel or 2 * coarse >= 1 << width:
        raise ValueError(f"{rows} rows of {chunk} values of {width} bits do not hold {numel} levels in "
                         f"[0, {2 * coarse}]")
    ends, factors, _ = _groups(groups, factors, numel)
    rng = _stream(rng)
    stats = None if stats is None else _output(stats, ends.numel() + 1, torch.float32)
    lib = _Library.handle

    def run(lo: int, hi: int) -> torch.Tensor | None:  # this range's statistics, zeroed first (all rows: stats)
        part = None if stats is None else stats if hi - lo == rows * chunk else torch.empty_like(stats)
        lib.hvdcomp_encode_planes(*x.arguments(), ends.data_ptr(), factors.data_ptr(), ends.numel(), coarse,
                                  width, rng.data_ptr(), chunk, lo // chunk, hi // chunk, size, out.data_ptr() + header,
                                  None if part is None else part.zero_().data_ptr())
        return part

    partials = _in_parallel(run, rows * chunk, max(chunk, 1))
    if stats is not None and len(partials) > 1:
        torch.amax(torch.stack(partials), dim=0, out=stats)
    return out


def sum_planes(rows: torch.Tensor, header: int, width: int, numel: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[numel]`` (into ``out`` if given: contiguous, that size): per value, the sum over the contiguous uint8
    ``[rows, bytes]`` ``rows`` (CPU) of the value their ``width`` bit planes after ``header`` bytes hold
    (``packing.unpack_planes(...).sum(0)``)."""
    count, size = _plane_rows("the stage-one rows", rows, header, numel, width)
    sums = _output(out, numel, torch.int32)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_sum_planes(rows.data_ptr() + header, count, size, width, numel, lo, min(hi, numel),
                               sums.data_ptr())

    _in_parallel(run, _whole_blocks(numel), OUTPUTS_PER_BLOCK)
    return sums


def requantize_planes(sums: torch.Tensor, total: int, coarse: int, width: int, scale: float, rng: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous uint8 ``[plane_bytes(n, width)]``, CPU) <- the bit planes of the chunk owner's levels
    plus ``coarse``: ``sign(t) min(floor(|t| / scale * coarse + U), coarse)`` for ``t = (sums - total) / total`` (int32
    ``[n]``, non-negative; ``1 <= total < 2**31``), ``U`` the uniforms ``0 .. n - 1`` of ``rng`` (``two_stage``, step
    3). Returns ``out``."""
    numel = _checked("the level sums", sums, torch.int32).numel()
    _checked("the stage-two planes", out, torch.uint8, plane_bytes(numel, width))
    if not (1 <= width <= MAX_PLANE_WIDTH and 2 * coarse < 1 << width and 1 <= total < 1 << 31 and scale > 0):
        raise ValueError(f"cannot re-quantize to {coarse} levels in {width} bits by scale {scale} over {total}")
    rng = _stream(rng)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_requantize_planes(sums.data_ptr(), numel, total, coarse, width, scale, rng.data_ptr(), lo,
                                      min(hi, numel), out.data_ptr())

    _in_parallel(run, _whole_blocks(numel), OUTPUTS_PER_BLOCK)
    return out


def decode_planes(rows: torch.Tensor, header: int, width: int, chunk: int, numel: int, row_factors: torch.Tensor,
                  groups: torch.Tensor, factors: torch.Tensor, coarse: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[numel]`` (into ``out`` if given: contiguous, that size): element ``r chunk + j`` is
    ``((v - coarse) row_factors[r]) factors[g] coarse`` for the value ``v`` of ``j`` in the bit planes after ``header``
    bytes of row ``r`` of contiguous uint8 ``[rows, bytes]`` ``rows`` (CPU; ``rows * chunk >= numel``), ``factors[g]``
    = ``M / s`` of its group ``g``."""
    count, size = _plane_rows("the gathered rows", rows, header, chunk, width)
    row_factors = _checked("the row factors", row_factors.contiguous(), torch.float32, count)
    if count * chunk < numel:
        raise ValueError(f"{count} rows of {chunk} values do not hold {numel}")
    ends, factors, _ = _groups(groups, factors, numel)
    out = _output(out, numel, torch.float32)
    lib = _Library.handle

    def run(lo: int, hi: int) -> None:
        lib.hvdcomp_decode_planes(rows.data_ptr() + header, size, width, chunk, numel, row_factors.data_ptr(),
                                  ends.data_ptr(), factors.data_ptr(), ends.numel(), coarse, lo // chunk, hi // chunk,
                                  out.data_ptr())

    _in_parallel(run, count * chunk, max(chunk, 1))
    return out
