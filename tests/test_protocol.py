"""One-process tests of the element-wise codecs: unbiasedness, variance bounds, agreement, edge cases."""

import pytest
import torch

from hvdcomp.codec.quantize import SCALE_FLOOR, MaxNormQuantizer, _few_long_groups
from hvdcomp.codec.random import stream_words
from hvdcomp.codec.selection import RandomCoordinateSelector
from hvdcomp.exchange.bucket import Segments
from hvdcomp.exchange.elementwise import FP16, MaxNormCodec, simulate_max_norm
from hvdcomp.exchange.hierarchy import hierarchical_elementwise
from hvdcomp.exchange.protocol import Op, Transport, relay, single
from hvdcomp.exchange.simulator import simulate

TILES = 8000  # draws per element: 16 elements x 8000 tiles = 128k draws per scheme


def _workers(codec_factory, world_size):
    """One codec per worker, bound to its rank."""
    codecs = [codec_factory() for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    return codecs


def _grads_on_half_levels(world_size, numel, levels, scale=1.0):
    """Per-worker values at half-integers of the finest unit (rounding variance at its bound),
    one element per worker reaching the shared max ``scale``."""
    gen = torch.Generator().manual_seed(123)
    grads = []
    for rank in range(world_size):
        k = torch.randint(0, levels, (numel,), generator=gen).float() + 0.5
        sign = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
        g = sign * k / levels * scale
        g[rank % numel] = scale
        grads.append(g)
    return grads


def _bias_z_scores(errors):
    """errors [tiles, numel] -> |mean| / (std / sqrt(tiles)) per element."""
    std = errors.std(dim=0).clamp_min(1e-12)
    return errors.mean(dim=0).abs() / (std / errors.shape[0] ** 0.5)


@pytest.mark.parametrize("bits,chunk_size", [((2,), None), ((4,), 16), ((8,), None), ((3, 6), None), ((2, 4, 8), 16)])
@pytest.mark.parametrize("word_bits", [63, 48])
def test_unbiased_and_variance_within_bound(bits, chunk_size, word_bits):
    world_size, numel = 3, 16
    quantizer = MaxNormQuantizer(bits, chunk_size)
    grads = _grads_on_half_levels(world_size, numel, quantizer.levels[0])
    if quantizer.multiscale:  # put a third of the elements in the finest range on every worker
        for g in grads:
            g[::3] *= quantizer.levels[0] / quantizer.levels[-1]
    tiled = [g.repeat(TILES) for g in grads]
    schemes = _workers(lambda: MaxNormCodec(quantizer), world_size)
    outputs = simulate_max_norm(schemes, tiled, word_bits=word_bits)
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])  # every worker decodes the same mean
    true_mean = torch.stack(grads).mean(dim=0)
    errors = (outputs[0].view(TILES, numel) - true_mean).double()
    assert _bias_z_scores(errors).max() < 4.5

    # Variance of the mean of W independent roundings: <= (M / s_j)**2 / 4 / W per element.
    agreed_levels = torch.full((numel,), float(quantizer.levels[0]))
    if quantizer.multiscale:
        agreed_levels[::3] = quantizer.levels[-1]
    bound = (1.0 / agreed_levels) ** 2 / 4 / world_size
    assert (errors.var(dim=0) <= bound * 1.1).all()
    # Half-integer values sit at the bound (except each worker's exact maximum, elements < W):
    # the test would catch a doubled rounding step.
    assert (errors.var(dim=0)[world_size:] >= bound[world_size:] * 0.9).all()


def test_multiscale_takes_min_over_workers():
    quantizer = MaxNormQuantizer((2, 4, 8))  # s = 3, 15, 255
    # element 0: fine on both; element 1: fine on one only; element 2: coarse; element 3: mid on both
    g0 = torch.tensor([0.01, 0.01, 1.0, 0.15])
    g1 = torch.tensor([0.01, 0.5, -1.0, 0.15])
    groups = quantizer.scale_groups(4)
    stats = torch.maximum(quantizer.local_stats(g0, groups), quantizer.local_stats(g1, groups))
    counts = quantizer.agreement_words(g0, stats, groups, 2) + quantizer.agreement_words(g1, stats, groups, 2)
    assert quantizer.agreed_resolutions(counts, 4, 2).tolist() == [2, 0, 0, 1]


def test_sparse_rescaled_is_unbiased():
    world_size, numel, tiles = 2, 16, 4000
    grads = _grads_on_half_levels(world_size, numel, 15)
    tiled = [g.repeat(tiles) for g in grads]

    def scheme():
        return MaxNormCodec(MaxNormQuantizer((4,)), RandomCoordinateSelector(ratio=0.25, seed=7), error_feedback=False)

    schemes = _workers(scheme, world_size)
    steps = [simulate_max_norm(schemes, tiled, key="w", step=t)[0].clone() for t in range(8)]  # a reused buffer
    outputs = torch.stack(steps).view(-1, numel)
    errors = (outputs - torch.stack(grads).mean(dim=0)).double()
    assert _bias_z_scores(errors).max() < 4.5
    # exactly k coordinates per step, the rest zero
    assert all(int((s != 0).sum()) <= round(0.25 * numel * tiles) for s in steps)


def test_sparse_error_feedback_loses_nothing_and_replicas_agree():
    world_size, numel, steps = 3, 50, 12
    gen = torch.Generator().manual_seed(5)
    schemes = _workers(
        lambda: MaxNormCodec(MaxNormQuantizer((16,)), RandomCoordinateSelector(k=7, seed=3)), world_size
    )
    applied = torch.zeros(numel)
    given = torch.zeros(numel)
    for step in range(steps):
        grads = [torch.randn(numel, generator=gen) for _ in range(world_size)]
        outputs = simulate_max_norm(schemes, grads, key="layer", step=step)
        for out in outputs[1:]:
            assert torch.equal(out, outputs[0])
        assert int((outputs[0] != 0).sum()) <= 7
        applied += outputs[0]
        given += torch.stack(grads).mean(dim=0)
    pending = torch.stack([s.memory.residual("layer", applied) for s in schemes]).mean(dim=0)
    # applied + what is still held back == everything given (up to 16-bit quantization noise)
    torch.testing.assert_close(applied + pending, given, atol=1e-3, rtol=0)


def test_coordinate_sets_shared_and_cover_everything():
    selector = RandomCoordinateSelector(k=4, seed=1)
    other = RandomCoordinateSelector(k=4, seed=1)
    cycle = [selector.indices(16, "w", step) for step in range(4)]
    assert torch.equal(torch.cat(cycle).sort().values, torch.arange(16))  # one cycle covers all
    for step in range(10):
        assert torch.equal(selector.indices(16, "w", step), other.indices(16, "w", step))
    assert not torch.equal(selector.indices(16, "w", 4), selector.indices(16, "w", 0))  # a new cycle
    assert not torch.equal(selector.indices(16, "w", 0), selector.indices(16, "b", 0))
    state = torch.get_rng_state()
    selector.indices(1000, "fresh", 0)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is never touched


def test_nonfinite_on_one_worker_gives_nan_everywhere_and_keeps_memory():
    schemes = _workers(lambda: MaxNormCodec(MaxNormQuantizer((4,)), RandomCoordinateSelector(k=2)), 2)
    simulate_max_norm(schemes, [torch.ones(4), torch.ones(4)], key="p", step=0)
    before = [s.memory.residual("p", torch.ones(4)).clone() for s in schemes]
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        grads = [torch.tensor([1.0, float("inf"), 2.0, 3.0]), torch.ones(4)]
        outputs = simulate_max_norm(schemes, grads, key="p", step=1)
    for out in outputs:
        assert torch.isnan(out).all()
    for scheme, old in zip(schemes, before):
        assert torch.equal(scheme.memory.residual("p", torch.ones(4)), old)


def test_fp16_error_feedback_keeps_memory_on_nonfinite_steps():
    """A step whose float16 sum overflows on one worker leaves every worker's residual as it was."""
    codecs = [FP16(error_feedback=True) for _ in range(2)]
    grads = [torch.tensor([0.1, 1 / 3, -2.0, 1e-4]), torch.tensor([0.2, 0.7, 1.1, -3e-4])]
    simulate([c.exchange(g, [4], "b", 0, 2) for c, g in zip(codecs, grads)])
    before = [c.memory.residual("b", grads[0]).clone() for c in codecs]
    assert all(bool(r.abs().sum() > 0) for r in before)  # rounding to float16 lost something
    overflow = [grads[0], grads[1] * torch.tensor([1.0, 1e6, 1.0, 1.0])]
    outputs = simulate([c.exchange(g, [4], "b", 1, 2) for c, g in zip(codecs, overflow)])
    assert all(not bool(torch.isfinite(out).all()) for out in outputs)
    for codec, old in zip(codecs, before):
        assert torch.equal(codec.memory.residual("b", grads[0]), old)
    outputs = simulate([c.exchange(g, [4], "b", 2, 2) for c, g in zip(codecs, grads)])  # and later steps work
    assert torch.equal(outputs[0], outputs[1]) and bool(torch.isfinite(outputs[0]).all())


def test_alltoall_and_fp16_sum_each_chunk_once_at_float32():
    """ALLTOALL hands worker i the i-th chunk of every worker; FP16 sums its float16 values at float32,
    rounds each sum once, and every worker gets the same, padding or not."""
    def swap(x):
        return (yield Op.ALLTOALL, x)

    received = simulate([swap(torch.arange(6) + 10 * rank) for rank in range(3)])
    assert [r.tolist() for r in received] == [[0, 1, 10, 11, 20, 21], [2, 3, 12, 13, 22, 23],
                                              [4, 5, 14, 15, 24, 25]]
    with pytest.raises(ValueError, match="splits into 3 parts"):
        simulate([swap(torch.arange(5)) for _ in range(3)])

    def gather(op, x):
        return (yield op, x)

    ragged = [torch.arange(rank + 1) for rank in range(3)]  # an all-gather may be ragged, unless it says otherwise
    assert simulate([gather(Op.ALLGATHER, x) for x in ragged])[2].tolist() == [0, 0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="ALLGATHER_EQUAL needs tensors of one shape"):
        simulate([gather(Op.ALLGATHER_EQUAL, x) for x in ragged])
    gen = torch.Generator().manual_seed(0)
    for numel in (1, 7, 301):
        grads = [torch.randn(numel, generator=gen) * 100 for _ in range(3)]
        outputs = simulate([FP16().exchange(g, [numel], "b", 0, 3) for g in grads])
        want = sum(g.half().float() for g in grads).half().float() / 3
        assert all(torch.equal(out, want) for out in outputs)


class _Transport(Transport):
    def __init__(self, rank, sums_float16=None):
        self.rank = rank
        if sums_float16 is not None:
            self.sums_float16 = sums_float16


@pytest.mark.parametrize("sums_float16", [None, False, True])
def test_fp16_asks_for_a_float16_sum_only_where_the_transport_has_a_fast_one(sums_float16):
    """Over torch.distributed (``sums_float16``) one SUM of the float16 bucket, as DDP's fp16 hook sends it;
    elsewhere the all-to-all and the all-gather. The error feedback is the same either way."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(301, generator=gen) for _ in range(3)]
    codecs = [FP16(error_feedback=True) for _ in range(3)]
    for rank, codec in enumerate(codecs):
        codec.bind_transport(_Transport(rank, sums_float16))
    ops = []
    exchanges = [c.exchange(g, [301], "b", 0, 3) for c, g in zip(codecs, grads)]
    exchanges[0] = relay(exchanges[0], lambda op, t: (ops.append((op, t.dtype, t.numel())), (op, t))[1])
    outputs = simulate(exchanges)
    if sums_float16:
        assert ops == [(Op.SUM, torch.float16, 301)]
    else:
        assert ops == [(Op.ALLTOALL, torch.float16, 303), (Op.ALLGATHER_EQUAL, torch.float16, 101)]
    want = sum(g.half().float() for g in grads) / 3
    for out in outputs:
        assert torch.equal(out, outputs[0])
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    for codec, grad in zip(codecs, grads):  # what rounding to float16 lost
        assert torch.equal(codec.memory.residual("b", grad), grad - grad.half().float())


@pytest.mark.parametrize("numel", [0, 1])
def test_empty_and_single_element(numel):
    for bits in [(4,), (2, 6)]:
        schemes = _workers(lambda bits=bits: MaxNormCodec(MaxNormQuantizer(bits)), 2)
        outputs = simulate_max_norm(schemes, [torch.full((numel,), 0.5), torch.full((numel,), -0.5)])
        assert outputs[0].shape == (numel,)
        assert torch.equal(outputs[0], torch.zeros(numel))


def test_all_zero_gradient_decodes_to_zero():
    schemes = _workers(lambda: MaxNormCodec(MaxNormQuantizer((8,), chunk_size=3)), 2)
    assert torch.equal(simulate_max_norm(schemes, [torch.zeros(10), torch.zeros(10)])[0], torch.zeros(10))


@pytest.mark.parametrize("bad", [(0,), (17,), (True,), (4, 4), (8, 4), (), (2.5,)])
def test_bad_bits(bad):
    with pytest.raises(ValueError):
        MaxNormQuantizer(bad)


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"k": -1}, {"ratio": 0.0}, {"ratio": 1.5}, {}, {"k": 2, "ratio": 0.5}])
def test_bad_selection(kwargs):
    with pytest.raises(ValueError):
        RandomCoordinateSelector(**kwargs)


def test_k_larger_than_tensor_sends_it_whole():
    assert RandomCoordinateSelector(k=11).indices(10, "w", 3).tolist() == list(range(10))


def test_bad_chunk_size():
    with pytest.raises(ValueError):
        MaxNormQuantizer((4,), chunk_size=0)


def test_scale_groups_per_tensor_and_chunk():
    assert MaxNormQuantizer((4,)).scale_groups(10, [3, 0, 7]).tolist() == [3, 7]
    assert MaxNormQuantizer((4,), chunk_size=3).scale_groups(10, [3, 0, 7]).tolist() == [3, 3, 3, 1]
    assert MaxNormQuantizer((4,), chunk_size=4).scale_groups(9).tolist() == [4, 4, 1]
    with pytest.raises(ValueError):
        MaxNormQuantizer((4,)).scale_groups(10, [3, 3])


@pytest.mark.parametrize("chunk_size", [None, 1])  # few long groups (one pass per group) / many (segmented)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
def test_local_stats_is_the_max_of_finite_magnitudes_per_group(chunk_size, dtype, poison):
    quantizer = MaxNormQuantizer((4,), chunk_size=chunk_size)
    pieces = [torch.tensor([-3.0, 2.0, -0.0]), torch.tensor([-5.0, -7.0]), torch.tensor([0.5, 4.0, 1.0, -2.0]),
              torch.zeros(3), torch.tensor([-0.0]), torch.linspace(-1.0, 0.5, 20)]
    if poison is not None:
        pieces[2][1] = poison
    x = torch.cat(pieces).to(dtype)
    groups = quantizer.scale_groups(x.numel(), [p.numel() for p in pieces])
    assert _few_long_groups(groups, x.numel()) == (chunk_size is None)
    ends = groups.cumsum(0).tolist()
    expected = [float(torch.nan_to_num(x.float()[end - n:end].abs(), nan=0.0, posinf=0.0).max())
                for n, end in zip(groups.tolist(), ends)]
    stats = quantizer.local_stats(x, groups)
    assert stats.dtype == torch.float32 and stats.tolist() == [*expected, float(poison is not None)]
    assert quantizer._per_element(stats[:-1], groups, x.numel(), x.numel() + 2).tolist() == \
        [*stats[:-1].repeat_interleave(groups).tolist(), 0.0, 0.0]
    for finite in (torch.tensor(False), torch.tensor(True)):  # a selection's whole tensor decides the flag
        assert quantizer.local_stats(x, groups, finite)[-1] == float(not finite)


@pytest.mark.parametrize("bits", [(4,), (16,), (4, 16)])
def test_zero_and_vanishing_groups_round_with_the_scale_floor(bits):
    """Groups whose maximum is 0 or subnormal (where ``s / M`` overflows float32) round with ``M = SCALE_FLOOR``:
    finite means, zeros exact, tiny values within one level ``SCALE_FLOOR / s``, and the groups sharing their
    words unharmed."""
    pieces = [torch.tensor([3.0, -1.5, 2.0]), torch.zeros(4), torch.tensor([1.0, 2.0, -3.0]),
              torch.tensor([1e-41, 0.0, -1e-41, 5e-42])]
    flat = torch.cat(pieces)
    codecs = _workers(lambda: MaxNormCodec(MaxNormQuantizer(bits)), 2)
    means = simulate([c.exchange(flat, [p.numel() for p in pieces], "tiny", 0, 2) for c in codecs])
    assert torch.equal(means[0], means[1]) and bool(torch.isfinite(means[0]).all())
    error = (means[0] - flat).abs()
    assert means[0][3:7].tolist() == [0.0] * 4
    unit = 3.0 / (2 ** bits[0] - 1)
    assert bool((error[:3] <= unit).all()) and bool((error[7:10] <= unit).all())
    assert bool((error[10:] <= SCALE_FLOOR / (2 ** bits[0] - 1)).all())
    quantizer = codecs[0].quantizer  # levels: within [-s_1, s_1], and 0 (almost surely) below SCALE_FLOOR
    groups = quantizer.scale_groups(flat.numel(), [p.numel() for p in pieces])
    stats = quantizer.local_stats(flat, groups)
    agreed = None
    if quantizer.multiscale:
        agreed = quantizer.agreed_resolutions(quantizer.agreement_words(flat, stats, groups, 1), flat.numel(), 1)
    levels = quantizer.quantize_levels(flat, stats, groups, agreed, stream_words(0, "tiny"))
    assert levels[3:7].tolist() == [0] * 4 and levels[10:].tolist() == [0] * 4
    s = quantizer.coarse_levels
    assert -s <= int(levels.min()) and int(levels.max()) <= s


def test_segments_get_their_own_scale():
    """A bucket of a large-magnitude and a small-magnitude tensor: per-tensor scales keep the small one exact
    to its own resolution, where one shared scale would round it to zero."""
    big, small = torch.full((5,), 100.0), torch.full((5,), 0.01)
    flat = torch.cat([big, small])
    schemes = _workers(lambda: MaxNormCodec(MaxNormQuantizer((2,))), 2)
    per_tensor = simulate([s.exchange(flat, [5, 5], 0, 0, 2) for s in schemes])
    assert torch.allclose(per_tensor[0], flat)
    one_scale = simulate([s.exchange(flat, [10], 0, 0, 2) for s in schemes])
    assert not torch.allclose(one_scale[0][5:], flat[5:])  # one scale of 100 cannot resolve 0.01


def test_sparse_segments_count_the_selected_elements():
    flat = torch.cat([torch.full((50,), 100.0), torch.full((50,), 0.01)])
    schemes = _workers(lambda: MaxNormCodec(MaxNormQuantizer((2,)), RandomCoordinateSelector(ratio=0.5)), 2)
    out = simulate([s.exchange(flat, [50, 50], 0, 0, 2) for s in schemes])[0]
    sent = out != 0
    assert torch.allclose(out[sent], flat[sent])  # exact at each tensor's own scale


SIZES = [27, 35, 45]  # a bucket of three tensors; 2 shards cut the last one


def _randk_workers(world_size, **selection):
    return _workers(lambda: MaxNormCodec(MaxNormQuantizer((16,)), RandomCoordinateSelector(seed=3, **selection),
                                         error_feedback=False), world_size)


def _bucket_grads(world_size):
    gen = torch.Generator().manual_seed(11)
    return [0.5 + 0.5 * torch.rand(sum(SIZES), generator=gen) for _ in range(world_size)]


def _sent_per_tensor(out):
    return [int((piece != 0).sum()) for piece in out.split(SIZES)]


def _hierarchical(codecs, grads, local_size, step=0):
    def run(rank, codec, grad):
        def shard(x, segments, shard_key, size):
            return codec.exchange(x, segments, shard_key, step, size)

        return hierarchical_elementwise(shard, grad.clone(), SIZES, "bucket0", local_size, rank % local_size,
                                        len(codecs) // local_size)

    return simulate([run(r, c, g) for r, (c, g) in enumerate(zip(codecs, grads))], local_size=local_size)


def test_segments_say_where_a_shard_lies():
    whole = Segments.of([3, 0, 4], "b")
    assert list(whole) == [3, 4] and whole.pieces() == ((0, 0, 3), (2, 0, 4)) and whole.hi == 7
    shard = Segments((3, 0, 4, 5), "b", 2, 9)
    assert list(shard) == [1, 4, 2] and shard.pieces() == ((0, 2, 1), (2, 0, 4), (3, 0, 2))
    assert Segments.of(shard, "other") is shard
    with pytest.raises(ValueError):
        Segments((3, 4), "b", 5, 8)


@pytest.mark.parametrize("selection,expected", [({"k": 14}, [14, 14, 14]), ({"ratio": 0.2}, [5, 7, 9])])
def test_randk_counts_per_tensor_in_a_bucket(selection, expected):
    grads = _bucket_grads(2)
    for step in range(3):
        outputs = simulate([c.exchange(g, SIZES, "bucket0", step, 2)
                            for c, g in zip(_randk_workers(2, **selection), grads)])
        assert torch.equal(outputs[0], outputs[1])
        assert _sent_per_tensor(outputs[0]) == expected
        # without error feedback each tensor's sent mean is scaled by its own numel / k (unbiased)
        mean, sent = torch.stack(grads).mean(0), outputs[0] != 0
        factor = torch.cat([torch.full((n,), n / k) for n, k in zip(SIZES, expected)])
        torch.testing.assert_close(outputs[0][sent], (mean * factor)[sent], rtol=1e-4, atol=0)


@pytest.mark.parametrize("selection", [{"k": 14}, {"ratio": 0.2}])
def test_randk_counts_per_tensor_across_shards(selection):
    """2 nodes x 2 (and 2 nodes x 3): each shard sends the tensor's chosen coordinates that fall in it,
    so every tensor sends the same coordinates as without sharding, identically on every worker."""
    for local_size in (2, 3):
        world_size = 2 * local_size
        grads = _bucket_grads(world_size)
        for step in range(3):
            outputs = _hierarchical(_randk_workers(world_size, **selection), grads, local_size, step)
            assert all(torch.equal(out, outputs[0]) for out in outputs)
            flat = simulate([c.exchange(g, SIZES, "bucket0", step, world_size)
                             for c, g in zip(_randk_workers(world_size, **selection), grads)])[0]
            assert torch.equal(outputs[0] != 0, flat != 0)


def test_k_larger_than_a_tensor_sends_it_whole_on_every_shard():
    """k=30 per tensor: the 27-element tensor goes whole, the others send 30 each, sharded or not."""
    grads = _bucket_grads(4)
    sharded = _hierarchical(_randk_workers(4, k=30), grads, 2)
    flat = simulate([c.exchange(g, SIZES, "bucket0", 0, 4) for c, g in zip(_randk_workers(4, k=30), grads)])
    for out in (sharded[0], flat[0]):
        assert [int((piece != 0).sum()) for piece in out.split(SIZES)] == [27, 30, 30]
    assert torch.equal(sharded[0] != 0, flat[0] != 0)


def test_simulate_group_collectives():
    """2 nodes x 2: local ops reduce within a node, cross ops across nodes, by rank layout r = node*2 + local."""

    def worker(rank):
        x = torch.tensor([float(rank)])
        local = yield Op.LOCAL_SUM, x
        cross = yield Op.CROSS_SUM, x
        gathered = yield Op.CROSS_ALLGATHER, x
        node = yield Op.LOCAL_ALLGATHER, x
        top = yield Op.MAX, x
        return local.item(), cross.item(), gathered.tolist(), node.tolist(), top.item()

    results = simulate([worker(r) for r in range(4)], local_size=2)
    assert results[0] == (1.0, 2.0, [0.0, 2.0], [0.0, 1.0], 3.0)
    assert results[3] == (5.0, 4.0, [1.0, 3.0], [2.0, 3.0], 3.0)
    with pytest.raises(ValueError):
        simulate([worker(r) for r in range(3)], local_size=2)


def test_simulate_sums_in_the_tensor_an_exchange_gives_up_and_never_writes_another():
    given = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    results = simulate([single(Op.SUM_IN_PLACE, t) for t in given])
    assert [r.data_ptr() for r in results] == [t.data_ptr() for t in given]
    assert all(torch.equal(t, torch.tensor([4.0, 6.0])) for t in given)
    kept = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    results = simulate([single(Op.SUM, t) for t in kept])
    assert all(torch.equal(r, torch.tensor([4.0, 6.0])) and r.data_ptr() != t.data_ptr() for r, t in zip(results, kept))
    assert torch.equal(kept[0], torch.tensor([1.0, 2.0])) and torch.equal(kept[1], torch.tensor([3.0, 4.0]))
