"""``AheadMaxNorm``: the bucket exchange of QSGD with its scale agreed one exchange ahead, W workers in one process."""

import types
import warnings

import pytest
import torch

from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import MaxNormCodec, Op, simulate
from hvdcomp.exchange.ahead import AheadMaxNorm
from hvdcomp.exchange.hierarchy import hierarchical_elementwise
from hvdcomp.exchange.protocol import relay

SIZES = [60, 40]


def _workers(world_size, bits=4, chunk_size=None):
    codecs = [AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size))) for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    return codecs


def _step(codecs, grads, step, ops=None, key="b"):
    """One exchange of ``grads`` (one flat tensor per worker); ``ops`` collects worker 0's requests."""
    exchanges = [codec.exchange(grad.clone(), SIZES, key, step, len(codecs)) for codec, grad in zip(codecs, grads)]
    if ops is not None:
        exchanges[0] = relay(exchanges[0], lambda op, tensor: (ops.append(op), (op, tensor))[1])
    results = simulate(exchanges)
    for result in results[1:]:
        torch.testing.assert_close(result, results[0], rtol=0, atol=0, equal_nan=True)
    return results[0]


def _excess(codec, key="b"):
    kept = codec.memory.state_dict()["excess"].get(key)
    return torch.zeros(sum(SIZES)) if kept is None else torch.zeros(sum(SIZES)).index_add_(0, *kept)


def _grads(gen, world_size, scale=1.0):
    return [torch.randn(sum(SIZES), generator=gen) * scale for _ in range(world_size)]


def test_first_exchange_is_exact_then_the_payload_goes_first():
    world_size = 3
    codecs = _workers(world_size)
    exact = [MaxNormCodec(MaxNormQuantizer((4,))) for _ in range(world_size)]
    for rank, codec in enumerate(exact):
        codec.bind_rank(rank)
    gen = torch.Generator().manual_seed(0)
    grads = _grads(gen, world_size)
    ops = []
    first = _step(codecs, grads, 0, ops)
    assert ops == [Op.MAX, Op.PAYLOAD]
    reference = simulate([codec.exchange(grad.clone(), SIZES, "b", 0, world_size) for codec, grad in zip(exact, grads)])
    assert torch.equal(first, reference[0])  # the same exchange, the same rounding stream
    ops = []
    _step(codecs, _grads(gen, world_size), 1, ops)
    assert ops == [Op.PAYLOAD, Op.MAX]  # no round before the payload; the MAX seeds the next scale


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_clipped_excess_is_sent_later_and_nothing_is_lost(chunk_size):
    world_size, bits = 3, 8
    codecs = _workers(world_size, bits, chunk_size)
    gen = torch.Generator().manual_seed(1)
    mean_total, grad_total = torch.zeros(sum(SIZES)), torch.zeros(sum(SIZES))
    clipped_steps = 0
    for step in range(8):
        grads = _grads(gen, world_size, 1.5**step)  # growing: each step clips against the previous step's scale
        grad_total += sum(grads) / world_size
        mean_total += _step(codecs, grads, step)
        clipped_steps += any(bool(_excess(codec).any()) for codec in codecs)
    assert clipped_steps >= 6
    kept = sum(_excess(codec) for codec in codecs) / world_size
    assert kept.abs().max() > 1.0  # the check below would see a lost excess
    # what was sent plus what each worker still owes adds up to the gradients, within the rounding of 8 steps
    unit = 1.5**8 * 5 / (2**bits - 1)
    assert (mean_total + kept - grad_total).abs().max() < unit


def test_without_clipping_the_mean_is_unbiased():
    world_size, trials = 2, 400
    codecs = _workers(world_size, bits=2)
    gen = torch.Generator().manual_seed(2)
    grads = _grads(gen, world_size)
    _step(codecs, grads, 0)  # agrees the scale: the same gradients never clip
    total = sum(_step(codecs, grads, step) for step in range(1, trials + 1))
    assert not any(bool(_excess(codec).any()) for codec in codecs)
    exact = sum(grads) / world_size
    unit = max(grad.abs().max() for grad in grads) / 3
    # the error of the mean of `trials` draws: standard deviation at most unit / (2 sqrt(W trials))
    assert (total / trials - exact).abs().max() < 5 * unit / (2 * (world_size * trials) ** 0.5)


def test_nonfinite_values_give_nan_everywhere_and_the_next_exchange_is_exact():
    world_size = 2
    codecs = _workers(world_size)
    gen = torch.Generator().manual_seed(3)
    _step(codecs, _grads(gen, world_size), 0)
    _step(codecs, _grads(gen, world_size, 4.0), 1)  # clips: an excess to keep
    owed = [_excess(codec) for codec in codecs]
    assert any(bool(kept.any()) for kept in owed)
    grads = _grads(gen, world_size)
    grads[1][7] = float("inf")
    ops = []
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        result = _step(codecs, grads, 2, ops)
    assert ops == [Op.PAYLOAD, Op.MAX] and result.isnan().all()
    for codec, kept in zip(codecs, owed):
        assert torch.equal(_excess(codec), kept)  # left as it was
    ops = []
    result = _step(codecs, _grads(gen, world_size), 3, ops)
    assert ops == [Op.MAX, Op.PAYLOAD] and result.isfinite().all()
    assert not any(bool(_excess(codec).any()) for codec in codecs)  # the exact exchange sent it


def test_a_resumed_state_continues_exactly():
    world_size = 2
    gen = torch.Generator().manual_seed(4)
    steps = [_grads(gen, world_size, 1.3**step) for step in range(5)]
    codecs = _workers(world_size)
    straight = [_step(codecs, grads, step) for step, grads in enumerate(steps)]
    codecs = _workers(world_size)
    for step in range(3):
        _step(codecs, steps[step], step)
    resumed = _workers(world_size)
    for codec, saved in zip(resumed, codecs):
        codec.load_state_dict(saved.state_dict())
    for step in range(3, 5):
        assert torch.equal(_step(resumed, steps[step], step), straight[step])


def test_a_state_saved_with_the_other_scale_mode_is_refused_before_anything_changes():
    exact = MaxNormCodec(MaxNormQuantizer((4,)))
    exact.bind_rank(0)
    codecs = _workers(1)
    _step(codecs, [torch.ones(sum(SIZES))], 0)
    before = codecs[0].state_dict()
    with pytest.raises(ValueError, match="scale='exact'"):
        codecs[0].load_state_dict(exact.state_dict())
    assert torch.equal(codecs[0].state_dict()["agreed"]["scales"]["b"][2], before["agreed"]["scales"]["b"][2])
    with pytest.raises(ValueError, match="not a MaxNormCodec state"):  # and back: what was still owed cannot be sent
        exact.load_state_dict(codecs[0].state_dict())


def test_a_nonfinite_agreed_scale_is_refused():
    codecs = _workers(1)
    _step(codecs, [torch.ones(sum(SIZES))], 0)
    state = codecs[0].state_dict()
    numel, size, scales = state["agreed"]["scales"]["b"]
    state["agreed"]["scales"]["b"] = (numel, size, torch.full_like(scales, float("nan")))
    fresh = _workers(1)[0]
    with pytest.raises(ValueError, match="not finite"):
        fresh.load_state_dict(state)
    assert fresh.memory.scales("b", numel, size, scales.numel() - 1) is None


def test_configurations_that_need_their_own_rounds_are_refused():
    from hvdcomp.codec.selection import RandomCoordinateSelector

    with pytest.raises(ValueError, match="single resolution"):
        AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((2, 6))))
    with pytest.raises(ValueError, match="single resolution"):
        AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)), RandomCoordinateSelector(k=3)))


def test_hierarchical_shards_agree_ahead_across_nodes():
    local_size, nodes = 2, 2
    codecs = _workers(local_size * nodes)
    gen = torch.Generator().manual_seed(5)

    def run(rank, codec, grad, step, ops):
        def shard(x, segments, shard_key, size):
            inner = codec.exchange(x, segments, shard_key, step, size)
            return relay(inner, lambda op, tensor: (ops.append(op), (op, tensor))[1]) if rank == 0 else inner

        return hierarchical_elementwise(shard, grad.clone(), SIZES, "b", local_size, rank % local_size, nodes)

    for step in range(3):
        grads = _grads(gen, local_size * nodes)
        ops = []
        results = simulate([run(r, c, g, step, ops) for r, (c, g) in enumerate(zip(codecs, grads))],
                           local_size=local_size)
        assert ops == ([Op.MAX, Op.PAYLOAD] if step == 0 else [Op.PAYLOAD, Op.MAX])
        exact = sum(grads) / len(grads)
        assert (results[0] - exact).abs().max() < 2 * max(g.abs().max() for g in grads) / 15
        for result in results[1:]:
            assert torch.equal(result, results[0])


def test_the_configuration_names_the_scale_mode_and_the_lanes():
    lanes = MaxNormCodec(MaxNormQuantizer((8,)))
    assert AheadMaxNorm(lanes).config() == (*lanes.config(), "ahead")
    assert AheadMaxNorm(lanes).config() != AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)))).config()


@pytest.mark.parametrize("chunk_size,rows", [(None, True), (64, False)])
def test_statistics_ride_in_the_payload_over_the_bound_transport(chunk_size, rows):
    """Bound to a transport of W workers, the statistics go in the payload's rows (one collective per exchange;
    with many scale groups the rows would weigh too much, and the MAX stays): the same means, scales and excess,
    bit for bit, as with the separate MAX, NaN/Inf steps included."""
    world_size, sizes = 3, [30000, 20000]
    riding = [AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,), chunk_size))) for _ in range(world_size)]
    for rank, codec in enumerate(riding):
        codec.bind_transport(types.SimpleNamespace(rank=rank, size=world_size))
    separate = _workers(world_size, chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        grads = [torch.randn(sum(sizes), generator=gen) * (1 + step % 2) for _ in range(world_size)]
        if step == 2:
            grads[1][7] = float("nan")
        results, ops = [], []
        for codecs in (riding, separate):
            exchanges = [codec.exchange(g.clone(), sizes, "b", step, world_size) for codec, g in zip(codecs, grads)]
            ops.append([])
            exchanges[0] = relay(exchanges[0], lambda op, tensor, seen=ops[-1]: (seen.append(op), (op, tensor))[1])
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                results.append(simulate(exchanges))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        for a, b in zip(riding, separate):
            state, want = a.memory.state_dict(), b.memory.state_dict()
            assert state["scales"].keys() == want["scales"].keys()
            assert all(torch.equal(state["scales"][k][2], want["scales"][k][2]) for k in want["scales"])
            assert all(torch.equal(x, y) for k in want["excess"] for x, y in zip(state["excess"][k], want["excess"][k]))
        exact = step in (0, 3)  # the first exchange, and the one after a NaN step
        assert ops[1] == ([Op.MAX, Op.PAYLOAD] if exact else [Op.PAYLOAD, Op.MAX])
        assert ops[0] == ops[1] if exact or not rows else ops[0] == [Op.PAYLOAD]
