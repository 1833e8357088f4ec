"""The two-stage exchange with the scale agreed ahead (``TwoStageMaxNorm(..., scale="ahead")``): its first exchange is
exact and seeds the scale; later ones send no MAX and give the exact exchange's bits where the scale has not moved;
what rises above the agreed scale is clipped, kept and sent later; NaN/Inf on one worker gives all-NaN everywhere and
an exact exchange next; a resumed state continues exactly; the native kernels send the eager bits; the doors build it
from ``QSGDMaxNorm``'s default scale."""

import pytest
import torch
from test_native import build, other_builds  # noqa: F401 (the fixtures)
from test_two_stage import _recorded

import hvdcomp
from hvdcomp.codec import fused, native
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import MaxNormCodec, Op, simulate
from hvdcomp.exchange.two_stage import TwoStageMaxNorm
from hvdcomp.integrations.resolve import resolve_codec

SIZES = [3000, 17, 5001]


def _codecs(world_size, scale="ahead", bits=4, chunk_size=None):
    codecs = [TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), seed=5), "two_stage", scale=scale)
              for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    return codecs


def _grads(world_size, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(SIZES), generator=gen) * scale for _ in range(world_size)]


def _step(codecs, grads, step, key="b"):
    """One exchange on every worker: (results, the ops worker 0 asked for)."""
    sent = []
    exchanges = [c.exchange(g, SIZES, key, step, len(codecs)) for c, g in zip(codecs, grads)]
    return simulate([_recorded(exchanges[0], sent)] + exchanges[1:]), [op for op, _ in sent]


def test_no_max_after_the_first_exchange_and_the_exact_bits_while_the_scale_holds():
    grads = _grads(3, seed=1)
    ahead, exact = _codecs(3), _codecs(3, scale="exact")
    for step in range(3):
        results, ops = _step(ahead, grads, step)
        want, _ = _step(exact, grads, step)
        assert ops == ([Op.MAX] if step == 0 else []) + [Op.ALLTOALL, Op.ALLGATHER]
        for got, expected in zip(results, want):  # the same gradients: the agreed scale is this step's maximum
            assert torch.equal(got, expected)
        assert all(torch.equal(r, results[0]) for r in results)
        assert "b" not in ahead[0].ahead.memory.state_dict()["excess"]  # nothing clipped


def test_what_rises_above_the_agreed_scale_is_kept_and_sent_later():
    codecs = _codecs(2)
    small = _grads(2, seed=2)
    _step(codecs, small, 0)  # the scale: the small gradients' maximum
    agreed = codecs[0].ahead.memory.scales("b", sum(SIZES), 2, 3)[:-1].clone()
    large = [g * 3 for g in small]
    results, _ = _step(codecs, large, 1)
    groups = torch.tensor(SIZES)
    limit = agreed.repeat_interleave(groups)
    for rank, codec in enumerate(codecs):
        indices, excess = codec.ahead.memory.state_dict()["excess"]["b"]
        want = (large[rank].abs() > limit).nonzero().squeeze(1)
        assert torch.equal(indices, want) and want.numel() > 0
        assert torch.equal(excess, large[rank][want] - large[rank][want].clamp(-limit[want], limit[want]))
    # sent as sign(x) M: the mean is that of the clipped values, within the rounding's spread
    clipped = torch.stack([torch.maximum(torch.minimum(g, limit), -limit) for g in large]).mean(0)
    assert (results[0] - clipped).abs().max() <= 2.5 * limit.max() / 15
    # the next step sends the excess (the new scale, the large maximum, holds it) and owes nothing after
    zeros = [torch.zeros(sum(SIZES)) for _ in range(2)]
    results, ops = _step(codecs, zeros, 2)
    assert ops == [Op.ALLTOALL, Op.ALLGATHER]
    owed = torch.zeros(2, sum(SIZES))
    for rank in range(2):
        indices = (large[rank].abs() > limit).nonzero().squeeze(1)
        owed[rank, indices] = large[rank][indices] - large[rank][indices].clamp(-limit[indices], limit[indices])
    scale = torch.stack([g.abs() for g in large]).amax(1).max()
    assert (results[0] - owed.mean(0)).abs().max() <= 2.5 * scale / 15
    assert all("b" not in c.ahead.memory.state_dict()["excess"] for c in codecs)


@pytest.mark.parametrize("kernels", [False, True])
def test_nonfinite_on_one_worker_gives_nan_everywhere_and_an_exact_exchange_next(kernels, monkeypatch):
    if kernels:  # the statistics from the encode's pass, the planes encoded again without the NaN
        monkeypatch.setenv(fused.ENV_SWITCH, "1")
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        assert native.library() is not None and native.usable(torch.zeros(1))
    codecs = _codecs(3)
    grads = _grads(3, seed=3)
    _step(codecs, grads, 0)
    _step(codecs, [g * 2 for g in grads], 1)  # some excess owed
    owed = [c.ahead.memory.state_dict()["excess"]["b"] for c in codecs]
    bad = [g.clone() for g in grads]
    bad[1][7] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN|Inf|non-finite"):
        results, ops = _step(codecs, bad, 2)
    assert ops == [Op.ALLTOALL, Op.ALLGATHER] and all(bool(r.isnan().all()) for r in results)
    for codec, (indices, excess) in zip(codecs, owed):  # still owed: nothing was delivered
        kept = codec.ahead.memory.state_dict()["excess"]["b"]
        assert torch.equal(kept[0], indices) and torch.equal(kept[1], excess)
    results, ops = _step(codecs, grads, 3)
    assert ops == [Op.MAX, Op.ALLTOALL, Op.ALLGATHER] and all(bool(r.isfinite().all()) for r in results)
    assert all("b" not in c.ahead.memory.state_dict()["excess"] for c in codecs)  # the exact exchange sent it


def test_a_resumed_state_continues_exactly_and_a_state_of_the_other_scale_is_refused():
    grads = [_grads(2, seed=10 + step, scale=1.0 + step) for step in range(4)]
    straight = _codecs(2)
    results = [_step(straight, grads[step], step)[0] for step in range(4)]
    saved = _codecs(2)
    for step in range(2):
        _step(saved, grads[step], step)
    resumed = _codecs(2)
    for codec, source in zip(resumed, saved):
        codec.load_state_dict(source.state_dict())
    for step in range(2, 4):
        assert all(torch.equal(a, b) for a, b in zip(_step(resumed, grads[step], step)[0], results[step]))
    with pytest.raises(ValueError, match="scale"):
        _codecs(1, scale="exact")[0].load_state_dict(saved[0].state_dict())
    with pytest.raises(ValueError, match="scale"):
        _codecs(1)[0].load_state_dict(_codecs(1, scale="exact")[0].state_dict())


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("world_size,bits,chunk_size", [(2, 4, None), (3, 2, 1000), (5, 7, 333)])
def test_native_kernels_send_the_eager_bits(world_size, bits, chunk_size, monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    assert native.library() is not None and native.usable(torch.zeros(1))
    grads = [_grads(world_size, seed=20 + step, scale=1.0 + step % 2) for step in range(3)]

    def run():
        codecs = _codecs(world_size, bits=bits, chunk_size=chunk_size)
        return [_step(codecs, grads[step], step)[0] for step in range(3)] + [
            [c.ahead.memory.state_dict()["excess"].get("b", (None, None))[1] for c in codecs]]

    natively = run()
    with fused.eager():
        eagerly = run()
    for a, b in zip(natively, eagerly):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_the_doors_build_it_from_the_default_scale():
    codec = resolve_codec(hvdcomp.QSGDMaxNorm(4), "two_stage")
    assert isinstance(codec, TwoStageMaxNorm) and codec.ahead is not None and codec.bucket_mb == 8.0
    assert codec.config() != resolve_codec(hvdcomp.QSGDMaxNorm(4, scale="exact"), "two_stage").config()
    auto = resolve_codec(hvdcomp.QSGDMaxNorm(4), "auto")
    grads = _grads(2, seed=4)
    auto.bind_rank(0)
    other = resolve_codec(hvdcomp.QSGDMaxNorm(4), "auto")
    other.bind_rank(1)
    for step in range(2):  # two workers: the lanes, with the scale agreed ahead
        exchanges = [c.exchange(g, SIZES, "b", step, 2) for c, g in zip((auto, other), grads)]
        simulate(exchanges)
        assert auto.ahead.memory.scales("b", sum(SIZES), 2, 3) is not None
    with pytest.raises(ValueError, match="rotation"):
        resolve_codec(hvdcomp.QSGDMaxNorm(4, rotate=True), "two_stage")
    with pytest.raises(ValueError, match="error feedback"):
        TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "two_stage", error_feedback=True, scale="ahead")
    with pytest.raises(ValueError, match="scale must be"):
        TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "two_stage", scale="later")
