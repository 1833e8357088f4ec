"""FP16's and BF16's fused kernels (``hvdcomp.codec.half``) equal their eager reference bit for bit, and the FP16
and BF16 exchanges give the same means and memories as FP16's former eager code, in buffers kept across steps.

The kernels compile once per world size here (a few seconds, cached on disk by Inductor afterwards)."""

import contextlib

import pytest
import torch

from hvdcomp.codec import fused
from hvdcomp.codec.half import add_rounding_error, mean_from_half_sums, round_to_half, sum_rows_to_half
from hvdcomp.exchange.elementwise import BF16, FP16
from hvdcomp.exchange.protocol import Op
from hvdcomp.exchange.simulator import simulate

SIZES = [0, 1, 2, 31, 65536 + 5]  # ragged: empty, one element, odd, > 65536
WORLD_SIZES = [2, 3, 8]


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    assert fused.enabled(), fused._Mode.failed


def _both_paths(run, *args):
    """``run(*args)``'s results with the kernels compiled, then eagerly."""
    results = []
    for context in (contextlib.nullcontext(), fused.eager()):
        with context:
            results.append(run(*args))
    return results


def _chunk_sum(rows):
    out = torch.empty(rows.shape[1], dtype=rows.dtype)
    sum_rows_to_half(rows, out)
    return (out,)


def _mean(sums, world_size, check_finite):
    out = torch.empty(sums.numel())
    return out, mean_from_half_sums(sums, world_size, out, check_finite)


def _round_and_update(flat, residual, dtype):
    """The ``dtype`` values in a send buffer (one element of padding) and the memory's update."""
    send, memory = torch.zeros(flat.numel() + 1, dtype=dtype), residual.clone()
    round_to_half(flat, memory, send[:-1])
    add_rounding_error(memory, flat, send[:-1])
    return send, memory


BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _same_bits(a, b):
    """Equal dtypes and shapes, NaN in the same places, the same bits elsewhere (a NaN's payload may differ:
    converting NaN to float16 gives 0x7fff eagerly, 0x7e00 compiled)."""
    nan = torch.isnan(a)
    return (a.dtype == b.dtype and torch.equal(nan, torch.isnan(b))
            and torch.equal(a.view(BITS[a.dtype])[~nan], b.view(BITS[b.dtype])[~nan]))


def _equal(got, want):
    return all(_same_bits(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, want, strict=True))


def _gradient(numel, generator, spread=1e3):
    """Values from 1e-6 to ``spread`` in size (float16 rounds them all differently), both signs."""
    return torch.randn(numel, generator=generator) * torch.logspace(-6, 0, 7)[torch.randint(7, (numel,),
                                                                                      generator=generator)] * spread


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_half_kernels_fused_equal_eager(world_size, dtype):
    """The chunk sum, the mean with its NaN/Inf check and the memory's update, on ragged sizes, with sums
    beyond the dtype's range and NaNs, on tensors laid out as FP16's (views of its buffers, received tensors)."""
    gen = torch.Generator().manual_seed(world_size)
    for numel in SIZES:
        received = _gradient(world_size * numel + 3, gen, spread=2e4).to(dtype)[:-3]  # [W * chunk] of a larger one
        rows = received.view(world_size, numel)
        if numel > 1:
            rows[:, 0] = torch.finfo(dtype).max * 0.9  # the sum is beyond the dtype's range: Inf
            rows[world_size - 1, numel // 2] = float("nan")
        got, want = _both_paths(_chunk_sum, rows)
        assert _equal(got, want), numel
        assert _same_bits(got[0], sum(row.float() for row in rows).to(dtype))  # rank order, rounded once
        if numel > 1:
            assert bool(torch.isinf(got[0]).any()) and bool(torch.isnan(got[0]).any())

        for sums in (received[:numel], torch.cat([got[0], got[0]])[:numel]):  # finite; with NaN and Inf
            for check_finite in (False, True):
                got_mean, want_mean = _both_paths(_mean, sums, world_size, check_finite)
                assert _equal(got_mean, want_mean), (numel, check_finite)
                assert _same_bits(got_mean[0], sums.float().div_(world_size))
                assert got_mean[1] == (bool(torch.isfinite(sums).all()) or not check_finite)

        flat, residual = _gradient(numel, gen), _gradient(numel, gen, spread=1e-3)
        got, want = _both_paths(_round_and_update, flat, residual, dtype)
        assert _equal(got, want), numel
        assert torch.equal(got[0][:numel], (residual + flat).to(dtype)) and got[0][numel] == 0
        assert torch.equal(got[1], residual + flat - got[0][:numel].float())


def _former_exchange(codec, flat, key, world_size):
    """FP16's exchange as it was before the fused kernels (the reference its results must keep), in the codec's
    16-bit dtype."""
    numel = flat.numel()
    padded = numel if codec.sums_natively else -(-numel // world_size) * world_size
    send = torch.zeros(padded, dtype=codec.half_dtype)
    half = send[:numel]
    residual = None
    if codec.memory is None:
        half.copy_(flat)
    else:
        residual = codec.memory.residual(key, flat)
        torch.add(residual, flat, out=half)
    if codec.sums_natively:
        total = yield Op.SUM, send
    else:
        received = yield Op.ALLTOALL, send
        rows = received.view(world_size, -1)
        partial = rows[0].float()
        for row in rows[1:]:
            partial.add_(row)
        total = yield Op.ALLGATHER, partial.to(codec.half_dtype)
    mean = total[:numel].float().div_(world_size)
    if residual is not None and bool(torch.isfinite(mean).all()):
        residual.add_(flat).sub_(half)
    return mean


class _Transport:
    def __init__(self, rank, sums_natively):
        self.rank, self.sums_float16, self.sums_bfloat16 = rank, sums_natively, sums_natively


@pytest.mark.parametrize("codec_type", [FP16, BF16])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_half_exchange_keeps_its_results(world_size, codec_type):
    """Both requests (16-bit SUM; all-to-all and all-gather), with and without error feedback, over
    ragged buckets and steps of which one overflows the 16-bit dtype: every worker's mean and memory equal the
    former eager exchange's, on both kernel paths; the buffers are allocated once per bucket."""
    gen = torch.Generator().manual_seed(10 + world_size)
    sizes = {"a": 65536 + 5, "b": 31, "c": 1, "d": 0}
    steps = [{key: [_gradient(n, gen) for _ in range(world_size)] for key, n in sizes.items()} for _ in range(3)]
    steps[1]["a"][world_size - 1][7] = 7e4 if codec_type is FP16 else float("inf")  # this step's sum holds Inf
    for sums_natively in (False, True):
        for error_feedback in (False, True):
            runs = {}
            for path, context in (("fused", contextlib.nullcontext), ("eager", fused.eager), ("former", None)):
                codecs = [codec_type(error_feedback) for _ in range(world_size)]
                for rank, codec in enumerate(codecs):
                    codec.bind_transport(_Transport(rank, sums_natively))
                means, buffers = [], {}
                for step, grads in enumerate(steps):
                    for key, workers in grads.items():
                        if path == "former":
                            exchanges = [_former_exchange(c, g, key, world_size) for c, g in zip(codecs, workers)]
                            results = simulate(exchanges)
                        else:
                            with context():
                                results = simulate([c.exchange(g, [g.numel()], key, step, world_size)
                                                    for c, g in zip(codecs, workers)])
                        assert all(_same_bits(r, results[0]) for r in results[1:])
                        if path == "fused":  # the same buffer every step
                            assert results[0].data_ptr() == buffers.setdefault(key, results[0].data_ptr())
                        means.append([r.clone() for r in results])
                memories = [c.state_dict()["residuals"] if error_feedback else {} for c in codecs]
                runs[path] = means, memories
            for path in ("fused", "eager"):
                for got, want in zip(runs[path][0], runs["former"][0], strict=True):
                    assert _equal(got, want), (path, sums_natively, error_feedback)
                for got, want in zip(runs[path][1], runs["former"][1], strict=True):
                    assert got.keys() == want.keys() and _equal(got.values(), want.values())
            overflow = runs["fused"][0][len(sizes)][0]  # step 1, bucket "a"
            assert not bool(torch.isfinite(overflow).all())
            if error_feedback:  # rounding lost something, kept for the next step
                assert any(bool(r.abs().sum() > 0) for r in runs["fused"][1][0].values())
