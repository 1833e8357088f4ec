"""The two-stage exchange (constant bits at any W), its all-to-all op, its cost model and its use by Birder,
in the one-process simulator."""

import pytest
import torch
from test_native import build, other_builds  # noqa: F401 (the fixtures)

from hvdcomp.codec import fused, native, native_planes
from hvdcomp.codec.packing import bits_to_bytes, pack_planes, plane_bytes, unpack_planes
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words
from hvdcomp.exchange import MaxNormCodec, Op, simulate
from hvdcomp.exchange.cost import (
    SCHEMES,
    CodecCost,
    Link,
    choose_exchange,
    exchange_cost,
    plain_width,
    two_stage_row_bytes,
)
from hvdcomp.exchange.hierarchy import hierarchical_elementwise
from hvdcomp.exchange.onebit import one_bit_route, two_stage_one_bit_mean
from hvdcomp.exchange.protocol import Placement, drive_together, single
from hvdcomp.exchange.two_stage import TwoStageMaxNorm
from hvdcomp.integrations.birder import Birder, simulate_step


def _codecs(world_size, bits=4, exchange="two_stage", error_feedback=False, chunk_size=None, seed=0):
    codecs = [TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), seed=seed), exchange,
                              error_feedback) for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    return codecs


def _run(codecs, grads, segments, step=0, key="b"):
    return simulate([c.exchange(g, segments, key, step, len(codecs)) for c, g in zip(codecs, grads)])


def _recorded(exchange, sent):
    """``exchange``, appending ``(op, bytes)`` of each request to ``sent``."""
    result = None
    while True:
        try:
            op, tensor = exchange.send(result) if result is not None else next(exchange)
        except StopIteration as done:
            return done.value
        sent.append((op, tensor.numel() * tensor.element_size()))
        result = yield op, tensor


def _grads(world_size, numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * torch.linspace(0.05, 1.0, numel) for _ in range(world_size)]


def test_alltoall_in_the_simulator_and_refused_where_results_interleave():
    parts = [torch.arange(6) + 10 * rank for rank in range(3)]
    received = simulate([single(Op.ALLTOALL, p) for p in parts])
    assert [r.tolist() for r in received] == [[0, 1, 10, 11, 20, 21], [2, 3, 12, 13, 22, 23], [4, 5, 14, 15, 24, 25]]
    cross = simulate([single(Op.CROSS_ALLTOALL, torch.tensor([rank, rank])) for rank in range(4)], local_size=2)
    assert [r.tolist() for r in cross] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # ranks 0 and 2 share local rank 0
    assert Op.ALLTOALL.across_nodes() is Op.CROSS_ALLTOALL and Op.ALLGATHER.across_nodes() is Op.CROSS_ALLGATHER
    with pytest.raises(ValueError, match="equal parts|split"):
        simulate([single(Op.ALLTOALL, torch.zeros(3)) for _ in range(2)])
    with pytest.raises(ValueError, match="ALLTOALL"):
        drive_together([single(Op.ALLTOALL, torch.zeros(2))], None, until=Op.PAYLOAD)


@pytest.mark.parametrize("width,numel", [(1, 13), (3, 8), (9, 37), (17, 5), (5, 0)])
def test_plain_planes_round_trip_at_exactly_width_bits(width, numel):
    values = torch.randint(0, 2**width, (3, numel), generator=torch.Generator().manual_seed(width))
    packed = pack_planes(values, width)
    assert packed.dtype == torch.uint8 and packed.shape == (3, plane_bytes(numel, width)) == (3, width * -(-numel // 8))
    assert torch.equal(unpack_planes(packed, width, numel), values)
    assert torch.equal(bits_to_bytes(torch.tensor([[1, 0, 1], [0, 1, 1]])), torch.tensor([[5], [6]], dtype=torch.uint8))


@pytest.mark.parametrize("world_size,bits", [(2, 2), (8, 4), (64, 3)])
def test_unbiased_and_variance_within_the_bound(world_size, bits):
    """E[result] = mean of the inputs (bias z-scores); Var <= (M / s)^2 (1 + 1 / W) / 4 per element. One exchange
    carries ``trials`` copies of two tensors (each copy its own scale, every rounding independent)."""
    numel, trials = 12, 400
    gen = torch.Generator().manual_seed(world_size)
    base = torch.randn(numel, generator=gen)
    grads = [base + 0.3 * torch.randn(numel, generator=gen) for _ in range(world_size)]  # chunk means near M
    truth = torch.stack(grads).mean(0).double()
    out = _run(_codecs(world_size, bits), [g.repeat(trials) for g in grads], [5, 7] * trials)
    assert all(torch.equal(o, out[0]) for o in out)  # every worker decodes the same bits
    samples = out[0].double().view(trials, numel)
    mean, var = samples.mean(0), samples.var(0)
    z = (mean - truth) / (var / trials).sqrt().clamp_min(1e-12)
    assert z.abs().max() < 4.5, z.abs().max()
    scale = torch.stack([torch.cat([g[:5].abs().max().expand(5), g[5:].abs().max().expand(7)]) for g in grads])
    bound = (scale.amax(0).double() / (2**bits - 1)) ** 2 * (1 + 1 / world_size) / 4
    assert (var <= 1.3 * bound).all(), (var / bound).max()  # slack for the estimate's sampling error (~7%)
    assert (var / bound).mean() > 0.1, (var / bound).mean()  # the bound is not vacuous


def test_messages_are_what_the_cost_model_counts():
    world_size, numel, bits = 5, 103, 6
    sent = []
    simulate([_recorded(c.exchange(g, [numel], "b", 0, world_size), sent)
              for c, g in zip(_codecs(world_size, bits), _grads(world_size, numel))])
    ops = dict(sent)
    assert len(set(sent)) == 3
    row = two_stage_row_bytes(numel, bits, world_size)
    assert ops[Op.ALLTOALL] == world_size * row and ops[Op.ALLGATHER] == row
    assert row == 4 + (bits + 1) * 3 and plain_width(bits) == bits + 1  # 21 elements a chunk: 3 bytes a plane


def test_error_feedback_on_both_stages_tracks_the_sum_and_resumes_exactly():
    """Nothing is lost: the results add up to the inputs' sum less what the memories hold (the workers' mean
    stage-1 residual, and each chunk owner's residual on its chunk)."""
    world_size, numel, steps = 4, 42, 12
    grads = _grads(world_size, numel, seed=3)
    codecs = _codecs(world_size, 2, error_feedback=True)
    total = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        total += _run(codecs, grads, [numel], step)[0].double()
    memories = [c.state_dict()["memory"]["residuals"] for c in codecs]
    worker_residual = torch.stack([m["b"] for m in memories]).double().mean(0)
    owner_residual = torch.cat([m[("b", "owner")] for m in memories]).double()[:numel]  # chunk j is rank j's
    assert owner_residual.abs().max() > 0 and worker_residual.abs().max() > 0
    expected = steps * torch.stack(grads).double().mean(0)
    torch.testing.assert_close(total + worker_residual + owner_residual, expected, rtol=0, atol=1e-4)

    codecs = _codecs(world_size, 2, error_feedback=True)
    for step in range(3):
        _run(codecs, grads, [numel], step)
    saved = [c.state_dict() for c in codecs]
    assert saved[0]["memory"]["residuals"].keys() == {"b", ("b", "owner")}
    expected = [_run(codecs, grads, [numel], step)[0] for step in range(3, 6)]
    resumed = _codecs(world_size, 2, error_feedback=True)
    for codec, state in zip(resumed, saved):
        codec.load_state_dict(state)
    assert all(torch.equal(e, _run(resumed, grads, [numel], step)[0]) for e, step in zip(expected, range(3, 6)))


def test_owner_memory_waits_while_its_tensor_is_all_zero():
    """A chunk owner's memory of a tensor whose values are all zero this step stays put (its M is 0: nothing
    can travel), rather than being sent at the scale floor, which would swamp the chunk's other values."""
    world_size, sizes = 2, [10, 30]  # owner 0's chunk: all of tensor 0 and the first 10 elements of tensor 1
    codecs = _codecs(world_size, 8, error_feedback=True)
    grads = [torch.cat([torch.zeros(10), g[10:]]) for g in _grads(world_size, 40, seed=6)]
    _run(codecs, grads, sizes, step=0)
    state = codecs[0].state_dict()
    state["memory"]["residuals"][("b", "owner")][:10] = 0.01  # left from steps when tensor 0 had gradients
    codecs[0].load_state_dict(state)
    mean = _run(codecs, grads, sizes, step=1)[0]
    truth = torch.stack(grads).mean(0)
    assert mean[:10].tolist() == [0.0] * 10
    assert bool(((mean[10:20] - truth[10:20]).abs() <= 0.05 * truth[10:].abs().max()).all())
    assert torch.equal(codecs[0].state_dict()["memory"]["residuals"][("b", "owner")][:10], torch.full((10,), 0.01))


def test_nonfinite_gives_nan_everywhere_and_keeps_the_memories():
    codecs = _codecs(3, 4, error_feedback=True)
    grads = _grads(3, 10)
    _run(codecs, grads, [10])
    before = [c.state_dict()["memory"] for c in codecs]
    grads[1][4] = float("inf")
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        out = _run(codecs, grads, [10], step=1)
    assert all(torch.isnan(o).all() for o in out)
    for codec, memory in zip(codecs, before):
        after = codec.state_dict()["memory"]["residuals"]
        assert all(torch.equal(after[k], v) for k, v in memory["residuals"].items())


def test_node_level_variant_runs_across_nodes():
    world_size, local_size, numel = 8, 2, 60
    codecs = _codecs(world_size, 4)
    grads = _grads(world_size, numel, seed=5)
    sent = []

    def one(codec, grad, rank):
        def shard(x, segments, key, size):
            return codec.exchange(x, segments, key, 0, size)

        return _recorded(hierarchical_elementwise(shard, grad.clone(), [numel], "b", local_size, rank % local_size,
                                                  world_size // local_size), sent)

    out = simulate([one(c, g, r) for r, (c, g) in enumerate(zip(codecs, grads))], local_size=local_size)
    assert {Op.LOCAL_SUM, Op.CROSS_MAX, Op.CROSS_ALLTOALL, Op.CROSS_ALLGATHER, Op.LOCAL_ALLGATHER} == dict(sent).keys()
    assert all(torch.equal(o, out[0]) for o in out)
    truth = torch.stack(grads).mean(0)
    assert (out[0] - truth).abs().max() < 2.5 * max(g.abs().max() for g in grads) / 15


def test_cost_model_picks_by_world_size_nodes_and_bucket_size():
    big = 6_553_600
    bits_per_element = {w: exchange_cost("two_stage", big, 8, w)[0] * 8 / big for w in (2, 32, 4096)}
    assert all(bits <= 2 * plain_width(8) + 0.1 for bits in bits_per_element.values())  # constant in W
    assert exchange_cost("lanes", big, 8, 4096)[0] * 8 / big > 2 * 21
    gigabit, wire_only = Link(bandwidth=1.25e8), CodecCost(lanes=0.0, two_stage=0.0)
    assert choose_exchange(big, 8, 32, link=gigabit) == "two_stage"  # one worker per node: two-stage
    assert choose_exchange(big, 8, 32) == "lanes"  # at 10 Gbit/s its extra codec passes cost more than it saves
    assert choose_exchange(big, 8, 32, codec=wire_only) == "two_stage"
    assert choose_exchange(big, 4, 4, link=gigabit, codec=CodecCost(two_stage=20e-9)) == "lanes"
    assert choose_exchange(1000, 8, 4096, codec=wire_only) == "lanes"  # tiny chunks: headers and padding dominate
    # the all-to-all loads the uplink L times
    assert choose_exchange(big, 8, 64, workers_per_node=8, link=gigabit, codec=wire_only) == "lanes"
    costs = {scheme: exchange_cost(scheme, big, 8, 64, 8, gigabit)[1] for scheme in SCHEMES}
    assert min(costs, key=costs.get) == "hierarchical_two_stage"
    modelled = _codecs(4, 8, exchange="auto", error_feedback=True)[0]  # no trial: the cost model per bucket
    assert modelled.trial is None and modelled.choose(big, 32) == choose_exchange(big, 8, 32)
    auto = _codecs(4, 8, exchange="auto")[0]  # the trial's route: the lanes, then the two-stage exchange
    assert auto.choose(big, 32) == "lanes" and auto.choose(10, 32) == "lanes"
    auto.trial.choice = True
    assert auto.choose(big, 32) == "two_stage" and auto.choose(10, 32) == "two_stage"
    assert auto.choose(big, 1) == "lanes"
    assert _codecs(4, 8, exchange="lanes")[0].trial is None and _codecs(4, 8)[0].trial is None
    assert TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4, 8))), "auto").trial is None  # lanes only
    with pytest.raises(ValueError, match="two_stage"):
        TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4, 8))), "two_stage")
    with pytest.raises(ValueError, match="exchange"):
        TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "fastest")


def test_one_bit_two_stage_is_unbiased():
    world_size, numel, trials = 6, 40, 300
    gen = torch.Generator().manual_seed(0)
    bits = [torch.rand(numel, generator=gen) < torch.linspace(0, 1, numel) for _ in range(world_size)]
    fraction = torch.stack(bits).double().mean(0)
    draws = []
    for trial in range(trials):
        streams = [stream_words(trial, 100, rank) for rank in range(world_size)]
        out = simulate([two_stage_one_bit_mean(b, s, world_size) for b, s in zip(bits, streams)])
        assert all(torch.equal(o, out[0]) for o in out)
        draws.append(out[0].double())
    mean = torch.stack(draws).mean(0)
    z = (mean - fraction) / (fraction * (1 - fraction) / trials).sqrt().clamp_min(1e-3)
    assert z.abs().max() < 5.0


@pytest.mark.parametrize("local_size,route", [(4, "world:two_stage"), (2, "hierarchical:two_stage")])
def test_birder_two_stage_routes(local_size, route):
    world_size = 4
    models = [torch.nn.Linear(9, 7) for _ in range(world_size)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    optimizers = [Birder(m.parameters(), lr=0.01, exchange="two_stage", hierarchical=True) for m in models]
    for step in range(2):
        for rank, model in enumerate(models):
            model.weight.grad = torch.randn(7, 9, generator=torch.Generator().manual_seed(10 * step + rank))
            model.bias.grad = torch.ones(7)
        simulate_step(optimizers, local_size=local_size if local_size < world_size else None)
    assert {opt.route for opt in optimizers} == {route}
    assert all(torch.equal(m.weight, models[0].weight) for m in models)
    many = Placement(0, 128, 1)
    assert one_bit_route(10**6, many, False, "auto", "auto") == "world:two_stage"  # 2 bits, not bit_length(128)
    assert one_bit_route(10**6, many, False, "auto", "lanes") == "world:sum"
    assert one_bit_route(10**6, Placement(0, 256, 2), True, "auto", "auto") == "hierarchical:two_stage"
    assert one_bit_route(10**6, Placement(0, 4, 2), True, "auto", "auto") == "hierarchical:allgather"  # 2 nodes


@pytest.fixture
def kernels_on(monkeypatch):
    """The native kernels on (the suite runs eagerly: tests/conftest.py)."""
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    assert native.library() is not None, fused._Mode.failed


@pytest.mark.usefixtures("kernels_on", "build")  # this CPU's build, then test_native's others
@pytest.mark.parametrize("world_size,bits,numel,chunk_size", [(2, 4, 10_001, None), (3, 2, 25_000, 1000),
                                                              (4, 8, 8, None), (5, 16, 4_099, 333), (7, 1, 61, None),
                                                              (2, 3, 300_000, 70_000), (3, 7, 1_000, None),
                                                              (2, 4, 1_100_001, None)])
def test_native_kernels_exchange_the_eager_bits(world_size, bits, numel, chunk_size):
    """The native kernels (stage one's planes, the owner's sum and re-quantization, the decode) give the eager
    reference's messages and result bit for bit, in every build: sizes off the 8-value plane groups, the 64-value
    groups of the AVX-512 loops and the 4096-value tiles, chunks straddling scale groups, 1 to 17-bit planes (8 bits
    exactly: 7-bit levels), several threads; a decode long enough to stream its means past the caches (rows of an odd
    length: each starts off a 32-byte boundary)."""
    grads = _grads(world_size, numel, seed=bits)
    segments = [numel // 3, numel - numel // 3]

    def exchanged():
        sent = []
        out = simulate([_recorded(c.exchange(g, segments, "b", 3, world_size), sent)
                        for c, g in zip(_codecs(world_size, bits, chunk_size=chunk_size), grads)])
        return out, sent

    assert native.usable(grads[0])
    natively, native_sent = exchanged()
    with fused.eager():
        eagerly, eager_sent = exchanged()
    assert native_sent == eager_sent
    for a, b in zip(natively, eagerly):
        assert torch.equal(a, b)


def test_native_kernels_refuse_rows_too_small_for_their_planes():
    x = torch.randn(100)
    groups, units = torch.tensor([100]), torch.tensor([3.0])
    rng = stream_words(0, 1, "b")
    with pytest.raises(ValueError, match="do not hold"):
        native_planes.encode_planes(x, groups, units, 3, 3, rng, 50, torch.zeros(2, 4 + 3 * 6, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="do not hold"):
        native_planes.encode_planes(x, groups, units, 3, 3, rng, 40, torch.zeros(2, 4 + 3 * 7, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="do not hold"):
        native_planes.sum_planes(torch.zeros(2, 10, dtype=torch.uint8), 4, 3, 17)
    with pytest.raises(ValueError, match="writes a contiguous"):  # an output of another size
        native_planes.sum_planes(torch.zeros(2, 4 + 3 * 3, dtype=torch.uint8), 4, 3, 17,
                                 torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="writes a contiguous"):
        native_planes.decode_planes(torch.zeros(2, 4 + 3 * 7, dtype=torch.uint8), 4, 3, 50, 100, torch.ones(2), groups,
                                    torch.tensor([1.0]), 3, torch.zeros(99))
    with pytest.raises(ValueError, match="plane"):
        native_planes.requantize_planes(torch.zeros(17, dtype=torch.int32), 6, 3, 3, 1.0, rng,
                                 torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot re-quantize"):  # the kernel's difference is 32-bit
        native_planes.requantize_planes(torch.zeros(16, dtype=torch.int32), 1 << 31, 3, 3, 1.0, rng,
                                        torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="row factors"):
        native_planes.decode_planes(torch.zeros(2, 30, dtype=torch.uint8), 4, 3, 50, 100, torch.ones(3), groups,
                             torch.tensor([1.0]), 3)
