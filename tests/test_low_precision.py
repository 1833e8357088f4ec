"""bfloat16 and float16 in one process: ``BF16``'s requests and sums, and bf16/fp16 gradients through every codec
as the doors run them (``fill_flat`` into the codec's flat dtype, the exchange, the mean written back in the
gradient's dtype), W workers simulated."""

import pytest
import torch

import hvdcomp
from hvdcomp.exchange import BF16, ElementwiseCodec, Op, Transport, simulate
from hvdcomp.exchange.protocol import relay
from hvdcomp.exchange.runner import fill_flat

WORLD = 4
SIZES = [33, 1, 120]  # one bucket of three tensors: a ragged total (154) that the all-to-all pads to 156


class _Transport(Transport):
    size = WORLD

    def __init__(self, rank, sums_bfloat16):
        self.rank, self.sums_bfloat16 = rank, sums_bfloat16


@pytest.mark.parametrize("sums_bfloat16", [False, True])
def test_bf16_sums_natively_only_where_the_transport_does(sums_bfloat16):
    """torch.distributed: one bfloat16 SUM (what DDP's bf16 hook sends); elsewhere the all-to-all and all-gather of
    bfloat16, the chunk summed at float32 and rounded to bfloat16 once. Error feedback keeps what rounding lost."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(301, generator=gen) for _ in range(3)]
    codecs = [BF16(error_feedback=True) for _ in range(3)]
    for rank, codec in enumerate(codecs):
        codec.bind_transport(_Transport(rank, sums_bfloat16))
    ops = []
    exchanges = [c.exchange(g, [301], "b", 0, 3) for c, g in zip(codecs, grads)]
    exchanges[0] = relay(exchanges[0], lambda op, t: (ops.append((op, t.dtype, t.numel())), (op, t))[1])
    outputs = simulate(exchanges)
    if sums_bfloat16:
        assert ops == [(Op.SUM, torch.bfloat16, 301)]
    else:
        assert ops == [(Op.ALLTOALL, torch.bfloat16, 303), (Op.ALLGATHER_EQUAL, torch.bfloat16, 101)]
        rounded_once = sum(g.bfloat16().float() for g in grads).bfloat16().float() / 3
        assert torch.equal(outputs[0], rounded_once)
    for out in outputs:
        assert out.dtype == torch.float32 and torch.equal(out, outputs[0])
        torch.testing.assert_close(out, sum(grads) / 3, rtol=2e-2, atol=2e-2)
    for codec, grad in zip(codecs, grads):
        assert torch.equal(codec.memory.residual("b", grad), grad - grad.bfloat16().float())


def test_bf16_keeps_float32_range_and_refuses_horovods_stock_optimizer():
    """Values far beyond float16's range stay finite in bfloat16; Horovod's own optimizer has no bfloat16."""
    codecs = [BF16() for _ in range(2)]
    for rank, codec in enumerate(codecs):
        codec.bind_transport(_Transport(rank, False))
    big = torch.tensor([1e30, -3e20, 7e4])
    outputs = simulate([c.exchange(big, [3], "k", 0, 2) for c in codecs])
    torch.testing.assert_close(outputs[0], big, rtol=1e-2, atol=0)
    with pytest.raises(TypeError, match="hvdcomp.DistributedOptimizer"):
        BF16().compress(big)
    assert BF16(error_feedback=True).config() != BF16().config()
    assert hvdcomp.BF16 is BF16


def _codecs():
    return {
        "none": lambda: hvdcomp.NoCompression(),
        "fp16": lambda: hvdcomp.FP16(error_feedback=True),
        "bf16": lambda: hvdcomp.BF16(error_feedback=True),
        "qsgd": lambda: hvdcomp.QSGDMaxNorm(8).inner,
        "qsgd-exact": lambda: hvdcomp.QSGDMaxNorm(8, scale="exact").inner,
        "multiscale": lambda: hvdcomp.QSGDMaxNormMultiScale((4, 8)).inner,
        "randk": lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.5, bits=8).inner,
        "randk-multiscale": lambda: hvdcomp.GlobalRandKMaxNormMultiScale(ratio=0.5, bits=(4, 8)).inner,
        "powersgd": lambda: hvdcomp.PowerSGD(rank=2, min_compression_rate=1.0),
    }


# the mean's distance from the exact one, relative to the gradients' largest magnitude (randk: half of the
# coordinates each step, the rest kept in memory; multiscale: 4-bit levels where they suffice; powersgd: rank 2 of
# 11 x 3 and 10 x 12 matrices)
TOLERANCE = {"none": 0.0, "fp16": 2e-3, "bf16": 2e-2, "qsgd": 2e-2, "qsgd-exact": 2e-2, "multiscale": 0.15,
             "randk": 1.0, "randk-multiscale": 1.0, "powersgd": 1.0}


def _door_step(codecs, grads, step):
    """One exchange of every worker's ``grads`` (one list of tensors per worker) as a door runs it: the means, in the
    gradients' shapes and dtype."""
    codec = codecs[0]
    if isinstance(codec, ElementwiseCodec):
        flats = []
        for worker in grads:
            flat = torch.empty(sum(SIZES), dtype=codec.flat_dtype(worker[0].dtype))
            fill_flat(flat, worker, SIZES)
            flats.append(flat)
        results = simulate([c.exchange(f, SIZES, "bucket0", step, WORLD) for c, f in zip(codecs, flats)])
        results = [r.split(SIZES) for r in results]
    else:
        results = simulate([c.exchange(g, "bucket0", step, WORLD) for c, g in zip(codecs, grads)])
    return [[mean.view(g.shape).to(g.dtype) for mean, g in zip(means, worker)] for means, worker in zip(results, grads)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(_codecs()))
def test_every_codec_returns_the_mean_of_bf16_and_fp16_gradients_in_their_dtype(name, dtype):
    """Three steps of W workers' 16-bit gradients: every worker gets the same means, in the gradients' dtype and
    shapes, close to the exact mean (exactly it, rounded to the dtype, without compression)."""
    gen = torch.Generator().manual_seed(7)
    codecs = [_codecs()[name]() for _ in range(WORLD)]
    for rank, codec in enumerate(codecs):
        codec.bind_transport(_Transport(rank, False))
    shapes = [(11, 3), (1,), (10, 12)]
    for step in range(3):
        grads = [[torch.randn(shape, generator=gen).to(dtype) for shape in shapes] for _ in range(WORLD)]
        means = _door_step(codecs, grads, step)
        exact = [sum(worker[i].double() for worker in grads) / WORLD for i in range(len(shapes))]
        scale = max(float(e.abs().max()) for e in exact) + max(float(g.abs().max()) for w in grads for g in w)
        for worker in means:
            assert [m.dtype for m in worker] == [dtype] * len(shapes)
            assert [m.shape for m in worker] == [torch.Size(s) for s in shapes]
            assert all(torch.equal(a, b) for a, b in zip(worker, means[0]))
        for mean, want in zip(means[0], exact):
            if name == "none":
                assert torch.equal(mean, want.to(dtype))
            else:
                assert float((mean.double() - want).abs().max()) <= TOLERANCE[name] * scale, (step, name)
