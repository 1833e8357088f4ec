"""The scale agreed one step ahead on the stock optimizer's path: ``AheadMaxNorm``'s exchange with its payload in
a float64 carrier (``carrier_bits``), reduced by one SUM as Horovod reduces it, W workers simulated in one process."""

import contextlib

import pytest
import torch

from hvdcomp.codec import carrier, fused
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import MaxNormCodec, Op, simulate
from hvdcomp.exchange.ahead import AheadMaxNorm
from hvdcomp.exchange.protocol import advance

TAG = 777


def _carried(codec, key, values, step, world_size, op):
    """One worker's exchange as the stock adapter runs it: with an agreed scale, the payload in a float64 carrier
    reduced by one SUM (``op="average"`` then scales it by 1/W, as Horovod's Average does); else the exact exchange.
    Returns (mean, whether the payload rode in the carrier)."""
    exchange = codec.exchange(values, [values.numel()], key, step, world_size,
                              carrier_bits=carrier.word_bits(world_size))
    request = advance(exchange, None)
    ahead = request[0] is Op.PAYLOAD
    while not isinstance(request, StopIteration):
        op_, tensor = request
        if ahead:
            assert op_ is Op.PAYLOAD
            assert tensor.dtype == torch.float64 and tensor.numel() > carrier.HEADER  # the carrier, but its header
            reduced = yield Op.SUM, carrier.seal(tensor.clone(), world_size, TAG)
            result, averaged = carrier.unwrap(reduced / world_size if op == "average" else reduced, world_size, TAG)
            assert averaged == (op == "average" and world_size > 1)
        else:
            result = yield op_, tensor
        request = advance(exchange, result)
    return request.value, ahead


def _workers(world_size, bits, chunk_size=None):
    codecs = [AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size))) for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    return codecs


def _step(codecs, grads, step, op="sum", key="w"):
    """One exchange of ``grads`` (one per worker). Returns (mean, what each worker meant to send: its gradient plus
    its excess, whether the payload rode in the carrier)."""
    world_size = len(grads)
    values = [codec.memory.with_excess(key, grad).clone() for codec, grad in zip(codecs, grads)]
    results = simulate([_carried(codec, key, grad.clone(), step, world_size, op)
                        for codec, grad in zip(codecs, grads)])
    for mean, ahead in results[1:]:  # identical on every worker
        torch.testing.assert_close(mean, results[0][0], rtol=0, atol=0, equal_nan=True)
        assert ahead == results[0][1]
    return results[0][0], values, results[0][1]


def _excess(codec, key="w"):
    return codec.state_dict()["agreed"]["excess"].get(key)


@pytest.mark.parametrize("chunk_size", [None, 16])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_clipped_excess_is_kept_and_sent_later(chunk_size, op):
    world_size, numel, bits = 3, 100, 4
    codecs = _workers(world_size, bits, chunk_size)
    quantizer = codecs[0].inner.quantizer
    gen = torch.Generator().manual_seed(5)
    sent_total = torch.zeros(numel)
    grad_total = torch.zeros(numel)
    clipped_steps = 0
    for step in range(8):
        # growing gradients: every step beyond the first clips against the previous step's scale
        grads = [torch.randn(numel, generator=gen) * (1.5**step) for _ in range(world_size)]
        grad_total += sum(grads)
        used = codecs[0].memory.scales("w", numel, world_size, quantizer.scale_groups(numel).numel())
        mean, values, ahead = _step(codecs, grads, step, op)
        assert ahead == (step > 0)  # the first exchange is exact: what each worker sent is its values, whole
        if not ahead:
            sent_total += sum(values)
            continue
        excess = [_excess(codec) for codec in codecs]
        clipped_steps += any(e is not None for e in excess)
        clipped_values = []
        for value, kept in zip(values, excess):
            clipped = value.clone()
            if kept is not None:
                indices, amounts = kept
                assert amounts.abs().min() > 0
                clipped[indices] -= amounts
            clipped_values.append(clipped)
            sent_total += clipped
        # the mean is within one unit M / s (M: the scale agreed at the previous step) of the clipped values'
        unit = used[:-1].repeat_interleave(quantizer.scale_groups(numel)) / (2**bits - 1)
        assert ((mean - sum(clipped_values) / world_size).abs() <= unit * 1.0001 + 1e-6).all()
    assert clipped_steps >= 6
    # nothing lost: what was sent plus what is still kept adds up to the gradients
    kept = torch.zeros(numel)
    for codec in codecs:
        indices_amounts = _excess(codec)
        if indices_amounts is not None:
            kept.index_add_(0, *indices_amounts)
    torch.testing.assert_close(sent_total + kept, grad_total, rtol=0, atol=1e-3)


def test_decoded_mean_is_unbiased_for_the_clipped_values():
    world_size, numel, bits = 2, 4000, 2
    codecs = _workers(world_size, bits)
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    _step(codecs, base, 0)  # exact: seeds the scale
    grads = [b * 1.2 for b in base]  # 20% larger: the top elements clip
    mean, values, ahead = _step(codecs, grads, 1)
    assert ahead
    agreed_before = torch.stack(base).abs().max()
    clipped = torch.stack([v.clamp(-agreed_before, agreed_before) for v in values]).mean(dim=0)
    unit = agreed_before / (2**bits - 1)
    error = mean - clipped
    assert error.abs().max() <= unit * 1.0001  # one rounding unit of the agreed scale at most
    assert error.mean().abs() < 4 * unit / (2 * (numel * world_size) ** 0.5)  # unbiased: mean error ~ 0


def test_nonfinite_gradient_gives_nan_everywhere_and_leaves_memory():
    world_size, numel = 2, 50
    codecs = _workers(world_size, 4)
    gen = torch.Generator().manual_seed(3)
    _step(codecs, [torch.randn(numel, generator=gen) for _ in range(world_size)], 0)
    _step(codecs, [torch.randn(numel, generator=gen) * 3 for _ in range(world_size)], 1)
    before = [_excess(codec) for codec in codecs]
    assert any(b is not None for b in before)  # something is kept to be left alone
    grads = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    grads[1][7] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN"):
        mean, _, ahead = _step(codecs, grads, 2)
    assert ahead and mean.isnan().all()
    for codec, saved in zip(codecs, before):
        after = _excess(codec)
        assert (after is None) == (saved is None)
        assert saved is None or all(torch.equal(a, b) for a, b in zip(after, saved))
        groups = codec.inner.quantizer.scale_groups(numel).numel()
        assert codec.memory.scales("w", numel, world_size, groups) is None  # the next exchange is exact
    assert not _step(codecs, [torch.randn(numel, generator=gen) for _ in range(world_size)], 3)[2]


def test_multiscale_is_refused():
    with pytest.raises(ValueError, match="single resolution"):
        AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((2, 6))))


@pytest.mark.parametrize("eager", [False, True])
def test_all_zero_gradients_ride_in_the_carrier(eager):
    """Zeros' statistics are +0.0 on every path (eager ``local_stats`` too), so their rows are carrier words."""
    codecs = _workers(2, 4)
    with fused.eager() if eager else contextlib.nullcontext():
        for step in range(3):
            mean, _, ahead = _step(codecs, [torch.zeros(50), -torch.zeros(50)], step)
            assert ahead == (step > 0) and torch.equal(mean, torch.zeros(50))
            assert not codecs[0].inner.quantizer.local_stats(-torch.zeros(50), torch.tensor([50])).signbit().any()
