"""Every codec on CUDA against the CPU, in the one-process simulator (``gpu`` marker; skipped without a GPU), and
the eager reference against the native CPU kernels (everywhere).

The rounding streams are counter-based (``hvdcomp.codec.random``): element ``i`` of a tensor draws the same
uniform on any device, so a codec's levels, and with them every integer payload and decoded mean, are the same
bits on a GPU as on the CPU. Each case runs three exchange steps of W workers (the scale-ahead codecs switch to
their agreed scale at the second) on the CPU (the native kernels), then on CUDA eagerly and with the fused
(``torch.compile``/Triton) kernels, and compares every worker's results bit for bit. Float sums are kept to
W = 2 (one addition, the same on any device); PowerSGD's matrix products are compared to float32 rounding.
``scripts/gpu_check.sh`` runs this file and ``benchmarks/codec_costs.py --device cuda``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

import hvdcomp
from hvdcomp.codec import fused
from hvdcomp.exchange import simulate
from hvdcomp.exchange.bucket import BucketCodec, ElementwiseCodec
from hvdcomp.exchange.protocol import Exchange
from hvdcomp.integrations.resolve import resolve_codec

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TARGETS = [pytest.param("cpu", "eager", id="cpu-eager"),  # the reference against the native kernels, anywhere
           pytest.param("cuda", "eager", id="cuda-eager", marks=GPU),
           pytest.param("cuda", "fused", id="cuda-fused", marks=GPU)]

SHAPES = [(3,), (61, 67), (256, 273), (1_000,)]  # sizes off the lane and Philox blocks; matrices for PowerSGD
SIZES = [torch.Size(shape).numel() for shape in SHAPES]

CODECS: dict[str, tuple[Callable[[], object], str, int]] = {  # name: (compression, exchange, workers)
    "none": (hvdcomp.NoCompression, "lanes", 2),
    "fp16": (hvdcomp.FP16, "lanes", 2),
    "fp16+ef": (lambda: hvdcomp.FP16(error_feedback=True), "lanes", 2),
    "qsgd2-ahead": (lambda: hvdcomp.QSGDMaxNorm(2), "lanes", 3),
    "qsgd4-ahead": (lambda: hvdcomp.QSGDMaxNorm(4), "lanes", 3),
    "qsgd8-exact": (lambda: hvdcomp.QSGDMaxNorm(8, scale="exact"), "lanes", 3),
    "qsgd4-chunked": (lambda: hvdcomp.QSGDMaxNorm(4, chunk_size=1_000, scale="exact"), "lanes", 3),
    "multiscale48": (lambda: hvdcomp.QSGDMaxNormMultiScale((4, 8)), "lanes", 3),
    "randk1": (lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.01), "lanes", 3),
    "randk1-multiscale": (lambda: hvdcomp.GlobalRandKMaxNormMultiScale(ratio=0.01, bits=(4, 8)), "lanes", 3),
    "qsgd4-two-stage": (lambda: hvdcomp.QSGDMaxNorm(4, scale="exact"), "two_stage", 3),
    "qsgd4-rotated": (lambda: hvdcomp.QSGDMaxNorm(4, rotate=True), "lanes", 3),
    "qsgd2-rotated-two-stage": (lambda: hvdcomp.QSGDMaxNorm(2, scale="exact", rotate=True), "two_stage", 3),
    "powersgd1": (lambda: hvdcomp.PowerSGD(rank=1), "lanes", 2),
}


def _gradients(world_size: int, step: int) -> list[torch.Tensor]:
    """Each worker's flat gradient of ``SHAPES`` at ``step`` (the same on every run)."""
    generator = torch.Generator().manual_seed(100 * step + world_size)
    numel = sum(SIZES)
    return [torch.randn(numel, generator=generator) * torch.linspace(0.01, 1.0, numel) for _ in range(world_size)]


def _exchange(codec: BucketCodec, flat: torch.Tensor, step: int, world_size: int) -> Exchange:
    """``codec``'s exchange of ``flat``: as one bucket (element-wise codecs) or as the tensors of ``SHAPES``."""
    if isinstance(codec, ElementwiseCodec):
        return codec.exchange(flat, SIZES, "bucket", step, world_size)
    return codec.exchange([piece.view(shape) for piece, shape in zip(flat.split(SIZES), SHAPES)], "bucket", step,
                          world_size)


def _exchange_steps(name: str, device: str) -> list[list[torch.Tensor]]:
    """Every worker's flat result (on the CPU) of each of three steps of ``name``, run on ``device``."""
    make, exchange, world_size = CODECS[name]
    codecs = [resolve_codec(make(), exchange) for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    results = []
    for step in range(3):
        grads = [g.to(device) for g in _gradients(world_size, step)]
        outs = simulate([_exchange(c, g, step, world_size) for c, g in zip(codecs, grads)])
        results.append([_flat(out).cpu() for out in outs])
    return results


def _flat(out: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else torch.cat([t.reshape(-1) for t in out])


@pytest.mark.parametrize("device,mode", TARGETS)
@pytest.mark.parametrize("name", sorted(CODECS))
def test_results_are_the_native_cpu_bits(name, device, mode, monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    expected = _exchange_steps(name, "cpu")
    with fused.eager() if mode == "eager" else contextlib.nullcontext():
        got = _exchange_steps(name, device)
    for step, (want, have) in enumerate(zip(expected, got)):
        for rank, (a, b) in enumerate(zip(want, have)):
            if name.startswith("powersgd"):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=f"step {step} rank {rank}")
            else:
                assert torch.equal(a, b), (f"step {step} rank {rank}: {int((a != b).sum())} of {a.numel()} "
                                           f"elements differ, max |diff| {float((a - b).abs().max())}")
