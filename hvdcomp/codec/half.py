"""16-bit float exchange math (``hvdcomp.exchange.elementwise.FP16`` and ``BF16``): rounding a bucket to float16
or bfloat16 (the *half* dtype), with its error-feedback residual; summing W workers' half chunks at float32 in rank
order, rounded once; the mean of the half sums; and the residual's update with what rounding lost. Pure tensor
math, no collectives.

Every function writes into buffers its caller keeps (``HalfBuffers`` per bucket, and the mean's). The passes over
several tensors run as fused kernels (``hvdcomp.codec.fused``): ``round_to_half`` with a residual,
``sum_rows_to_half`` (W reads, one write), ``mean_from_half_sums`` (with the NaN/Inf check in the same pass) and
``add_rounding_error``, because fused passes cost a fraction of the eager ones
(docs/benchmarks.md#kernel-level-measurements). Compiled, they write straight into those buffers (no gradient-sized
temporary; eagerly the chunk sum and the NaN/Inf check allocate one). On the CPU the mean runs as a native kernel
where ``native.usable`` says (``hvdcomp.codec.native_half``). Their ``_eager`` functions are the readable
reference: the same float32 operations in the same order, so both paths give the same bits (but for a NaN's payload:
eager float16 conversion gives 0x7fff, compiled 0x7e00; both are NaN).
"""

from __future__ import annotations

import torch

from . import native, native_half
from .fused import FusedKernel, static

HALF_DTYPES = (torch.float16, torch.bfloat16)


class HalfBuffers:
    """One bucket's buffers, kept across steps: ``send`` (``dtype``, a half dtype, ``[padded]``: the values rounded
    to ``dtype``, then zeros; ``chunked``: ``padded`` is ``numel`` rounded up to a multiple of ``world_size``, else
    ``numel``) and ``chunk_sum`` (``dtype`` ``[padded / world_size]``: this worker's chunk of the sum, when
    ``chunked``; else None)."""

    def __init__(self, numel: int, world_size: int, chunked: bool, device: torch.device, dtype: torch.dtype) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"dtype must be one of {HALF_DTYPES}, got {dtype}")
        self.shape = (numel, world_size, chunked)
        padded = -(-numel // world_size) * world_size if chunked else numel
        self.send = torch.zeros(padded, dtype=dtype, device=device)  # the padding stays 0
        self.chunk_sum = torch.empty(padded // world_size, dtype=dtype, device=device) if chunked else None

    def fits(self, numel: int, world_size: int, chunked: bool, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether these are the buffers ``HalfBuffers(numel, world_size, chunked, device, dtype)`` would make."""
        return self.shape == (numel, world_size, chunked) and self.send.device == device and self.send.dtype == dtype


def _check(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    if tensor.dtype not in dtypes or tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))} of shape {shape}, got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")


def _round_sum_eager(residual: torch.Tensor, flat: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (a half dtype) <- ``residual + flat`` at float32, rounded once."""
    torch.add(residual, flat, out=out)


def _sum_rows_eager(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (``[c]``, or ``[R, c]``: each row) <- ``rows[0] + rows[1] + ... + rows[W - 1]`` at float32, left to
    right, rounded once."""
    partial = rows[0].float()
    for index in range(1, rows.shape[0]):  # rank order
        partial.add_(rows[index])
    out.copy_(partial)


def _mean_eager(sums: torch.Tensor, world_size: int, out: torch.Tensor) -> None:
    """``out`` (float32) <- ``sums`` (a half dtype) / ``world_size`` at float32."""
    out.copy_(sums).div_(world_size)


def _mean_all_finite_eager(sums: torch.Tensor, world_size: int, out: torch.Tensor) -> torch.Tensor:
    """``_mean_eager``, and a 0-d bool: no element of ``out`` is NaN or ±Inf."""
    _mean_eager(sums, world_size, out)
    return torch.isfinite(out).all()


def _add_rounding_error_eager(residual: torch.Tensor, flat: torch.Tensor, half: torch.Tensor) -> None:
    """``residual`` <- ``(residual + flat) - half`` at float32."""
    residual.add_(flat).sub_(half)


_round_sum = FusedKernel(_round_sum_eager, in_place=True)
_sum_rows = FusedKernel(_sum_rows_eager, in_place=True)
_mean = FusedKernel(_mean_eager, in_place=True)
_mean_all_finite = FusedKernel(_mean_all_finite_eager, in_place=True)
_add_rounding_error = FusedKernel(_add_rounding_error_eager, in_place=True)


def round_to_half(flat: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out`` (float16 or bfloat16 ``[n]``) <- ``residual + flat`` (float32 ``[n]`` each; ``flat`` alone without a
    residual), added at float32 and rounded to ``out``'s dtype once (to nearest, ties to even), in one pass. Beyond
    its range: ±Inf."""
    _check("out", out, HALF_DTYPES, tuple(flat.shape))
    if residual is None:
        out.copy_(flat)
    else:
        _round_sum(residual, flat, out)


def sum_rows_to_half(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (``rows``' dtype ``[c]``, or ``[R, c]``: every row gets it) <- the sum of the W rows of ``rows``
    (float16 or bfloat16 ``[W, c]``: one chunk per worker, by rank), added at float32 in rank order and rounded to
    that dtype once, in one pass."""
    if rows.dtype not in HALF_DTYPES or rows.dim() != 2 or not rows.shape[0]:
        raise ValueError(f"rows must be float16 or bfloat16 [W >= 1, c], got {rows.dtype} {tuple(rows.shape)}")
    if out.dim() == 2:
        _check("out", out, (rows.dtype,), (out.shape[0], rows.shape[1]))
        _sum_rows(static(rows, 0), static(out, 0))  # one graph per (W, R)
    else:
        _check("out", out, (rows.dtype,), (rows.shape[1],))
        _sum_rows(static(rows, 0), out)  # the loop over the rows unrolls: one graph per W


def mean_from_half_sums(sums: torch.Tensor, world_size: int, out: torch.Tensor, check_finite: bool = False) -> bool:
    """``out`` (float32 ``[n]``) <- ``sums`` (float16 or bfloat16 ``[n]``, the workers' sum) / ``world_size``, in one
    pass.

    Returns False when ``check_finite`` and some mean is NaN or ±Inf (checked in the same pass), else True."""
    _check("out", out, (torch.float32,), tuple(sums.shape))
    if sums.dtype not in HALF_DTYPES:
        raise ValueError(f"sums must be float16 or bfloat16, got {sums.dtype}")
    if native.usable(out) and native.usable(sums, sums.dtype):
        return native_half.half_mean(sums, world_size, out, check_finite)
    if not check_finite:
        _mean(sums, world_size, out)
        return True
    return bool(_mean_all_finite(sums, world_size, out))


def add_rounding_error(residual: torch.Tensor, flat: torch.Tensor, half: torch.Tensor) -> None:
    """In place, one pass: ``residual += flat - half`` (float32 ``residual`` and ``flat``, float16 or bfloat16
    ``half`` = ``round_to_half(flat, residual)``), computed as ``(residual + flat) - half`` at float32: what
    rounding lost."""
    _check("half", half, HALF_DTYPES, tuple(residual.shape))
    _add_rounding_error(residual, flat, half)
