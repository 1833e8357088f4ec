"""The scale agreed one step ahead (``scale="ahead"``), W workers simulated in one process."""

import pytest
import torch

from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words
from hvdcomp.exchange.protocol import Op
from hvdcomp.exchange.simulator import simulate
from hvdcomp.integrations.scale_ahead import ScaleAhead

TAG = 777


def _ahead_exchange(state, key, values, world_size, rank, rounding, op):
    """One worker's ahead exchange as a protocol exchange: a single SUM of its carrier (``op="average"``
    then scales by 1/W, as Horovod's Average does)."""
    payload, exchange = state.start(key, values, world_size, rank, TAG, rounding)
    reduced = yield Op.SUM, payload.clone()
    if op == "average":
        reduced = reduced / world_size
    return state.finish(exchange, reduced)


def _step(states, quantizer, grads, streams, op="sum", key="w"):
    """One exchange of ``grads`` (one per worker): exact (the MAX of the local statistics seeds the agreed
    scale, the values sent whole) when no scale is agreed yet, else ahead. Returns (mean, what each worker
    meant to send)."""
    world_size = len(grads)
    values = [state.with_excess(key, grad).clone() for state, grad in zip(states, grads)]
    numel = grads[0].numel()
    if not states[0].ready(key, numel, world_size):
        groups = quantizer.scale_groups(numel)
        stats = torch.stack([quantizer.local_stats(v, groups) for v in values]).amax(dim=0)
        for state in states:
            assert not state.ready(key, numel, world_size)
            state.agree(key, numel, world_size, stats)
        return None, values
    results = simulate([_ahead_exchange(state, key, v, world_size, rank, gen, op)
                        for rank, (state, v, gen) in enumerate(zip(states, values, streams))])
    means = [mean for mean, _, _ in results]
    for mean, averaged, _ in results:  # identical on every worker
        torch.testing.assert_close(mean, means[0], rtol=0, atol=0, equal_nan=True)
        assert averaged == (op == "average")
    return means[0], values


@pytest.mark.parametrize("chunk_size", [None, 16])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_clipped_excess_is_kept_and_sent_later(chunk_size, op):
    world_size, numel, bits = 3, 100, 4
    quantizer = MaxNormQuantizer((bits,), chunk_size)
    states = [ScaleAhead(quantizer) for _ in range(world_size)]
    streams = [stream_words(0, rank) for rank in range(world_size)]  # each worker's rounding stream
    gen = torch.Generator().manual_seed(5)
    sent_total = torch.zeros(numel)
    grad_total = torch.zeros(numel)
    clipped_steps = 0
    for step in range(8):
        # growing gradients: every step beyond the first clips against the previous step's scale
        grads = [torch.randn(numel, generator=gen) * (1.5**step) for _ in range(world_size)]
        grad_total += sum(grads)
        scales_before = states[0].state_dict()["scales"].get("w")
        mean, values = _step(states, quantizer, grads, streams, op)
        if mean is None:  # the first exchange is exact; what each worker sent is its values, whole
            assert step == 0
            sent_total += sum(values)
            continue
        _, _, used = scales_before
        excess = [state.state_dict()["excess"].get("w") for state in states]
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
    for state in states:
        indices_amounts = state.state_dict()["excess"].get("w")
        if indices_amounts is not None:
            kept.index_add_(0, *indices_amounts)
    torch.testing.assert_close(sent_total + kept, grad_total, rtol=0, atol=1e-3)


def test_decoded_mean_is_unbiased_for_the_clipped_values():
    world_size, numel, bits = 2, 4000, 2
    quantizer = MaxNormQuantizer((bits,))
    states = [ScaleAhead(quantizer) for _ in range(world_size)]
    streams = [stream_words(0, 10 + rank) for rank in range(world_size)]  # each worker's rounding stream
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    _step(states, quantizer, base, streams)  # exact: seeds the scale
    grads = [b * 1.2 for b in base]  # 20% larger: the top elements clip
    mean, values = _step(states, quantizer, grads, streams)
    agreed_before = torch.stack(base).abs().max()
    clipped = torch.stack([v.clamp(-agreed_before, agreed_before) for v in values]).mean(dim=0)
    unit = agreed_before / (2**bits - 1)
    error = mean - clipped
    assert error.abs().max() <= unit * 1.0001  # one rounding unit of the agreed scale at most
    assert error.mean().abs() < 4 * unit / (2 * (numel * world_size) ** 0.5)  # unbiased: mean error ~ 0


def test_nonfinite_gradient_gives_nan_everywhere_and_leaves_memory():
    world_size, numel = 2, 50
    quantizer = MaxNormQuantizer((4,))
    states = [ScaleAhead(quantizer) for _ in range(world_size)]
    streams = [stream_words(0, rank) for rank in range(world_size)]  # each worker's rounding stream
    gen = torch.Generator().manual_seed(3)
    _step(states, quantizer, [torch.randn(numel, generator=gen) for _ in range(world_size)], streams)
    _step(states, quantizer, [torch.randn(numel, generator=gen) * 3 for _ in range(world_size)], streams)
    before = [state.state_dict() for state in states]
    assert any(b["excess"] for b in before)  # something is kept to be left alone
    grads = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    grads[1][7] = float("nan")
    mean, _ = _step(states, quantizer, grads, streams)
    assert mean.isnan().all()
    for state, saved in zip(states, before):
        after = state.state_dict()["excess"]
        assert after.keys() == saved["excess"].keys()
        for key in after:
            assert all(torch.equal(a, b) for a, b in zip(after[key], saved["excess"][key]))
        assert not state.ready("w", numel, world_size)  # the next exchange is exact


def test_multiscale_is_refused():
    with pytest.raises(ValueError, match="single resolution"):
        ScaleAhead(MaxNormQuantizer((2, 6)))
