"""Gradients read where they lie (``hvdcomp.codec.pieces``): the native kernels that take a bucket's values as
``Pieces`` (the lanes' and the bit planes' encodes with their statistics, the clipped excess) give bit for bit what
they give for the flat vector, however the pieces cut it (empty pieces, single values, cuts inside a kernel's tile
of 4096 values, pieces of many tiles), in every build of ``test_native.BUILDS``, on 1 and 3 threads; the kernels and
the wrappers refuse pieces that do not fit; the scale-ahead exchanges (lanes and two-stage) give the same means and
memories from pieces as from the filled vector, through the exact first step, clipping, the excess and a NaN, and
fill the flat buffer only for an exact exchange or a NaN (an owed excess rides along as the pieces' addend, which
the kernels add bit for bit as the filled vector has it); the runner hands the gradients as pieces to a codec that
reads them, and fills the bucket's flat buffer for the others."""

import pytest
import torch
from fakes import EchoTransport
from test_native import _gradient, _native_on, build, other_builds, threads  # noqa: F401 (fixtures)

from hvdcomp.codec import native, native_excess, native_planes
from hvdcomp.codec.agreed import AgreedScales
from hvdcomp.codec.pieces import Pieces
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words
from hvdcomp.exchange import BF16, FP16, AheadMaxNorm, MaxNormCodec, NoCompression, TwoStageMaxNorm, simulate
from hvdcomp.exchange.hierarchy import bucket_exchange
from hvdcomp.exchange.plan import plan_buckets
from hvdcomp.exchange.runner import Runner
from hvdcomp.exchange.state import ExchangeState

CUTS = {  # lengths of the pieces of one vector
    "one": [70_001],
    "ragged": [0, 1, 4095, 4097, 0, 3, 20_000, 7, 41_798, 0],
    "singles": [1] * 300 + [9_700],
    "tile-edges": [4096, 4096, 8192, 1, 4095, 12_288],
}


def _cut(x: torch.Tensor, lengths: list[int]) -> Pieces:
    """``x`` as pieces of ``lengths``, each a tensor of its own (its own storage, a shape of its own)."""
    parts = [part.clone() for part in x.split(lengths)]
    return Pieces([part.view(-1, 1) if part.numel() % 2 else part for part in parts])


def _case(numel: int, seed: int) -> tuple[torch.Tensor, MaxNormQuantizer, torch.Tensor, torch.Tensor]:
    """Values, a 4-bit quantizer, ragged scale groups (not where the pieces are cut) and their units."""
    x = _gradient(numel, seed)
    quantizer = MaxNormQuantizer((4,), chunk_size=3000)
    groups = quantizer.scale_groups(numel, [numel // 3, numel - numel // 3])
    return x, quantizer, groups, quantizer.group_units(quantizer.local_stats(x, groups))


def _addend(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Places (the first and last value, both sides of tile edges, a run, scattered ones) and values to add there."""
    places = torch.tensor(sorted({0, 1, 4095, 4096, 4097, 8191, 8192, *range(9000, 9040), *range(11, numel, 997),
                                  numel - 2, numel - 1}), dtype=torch.int64)
    return places, torch.randn(places.numel(), generator=torch.Generator().manual_seed(3)) * 5


@pytest.mark.parametrize("added", [False, True], ids=["plain", "addend"])
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.usefixtures("threads", "build")
def test_the_kernels_read_pieces_as_the_vector_they_cut(cut, added):
    numel = sum(CUTS[cut])
    x, quantizer, groups, units = _case(numel, 5)
    pieces, rng = _cut(x, CUTS[cut]), stream_words(3, 1, "pieces", 0, "k")
    if added:  # the kernels read x plus the addend, as the filled vector holds it
        pieces = pieces.plus(*_addend(numel))
        x = x.clone().index_add_(0, *_addend(numel))
    assert pieces.numel == numel and torch.equal(pieces.fill(torch.empty(numel)), x)
    for lanes, width, float_words in ((10, 6, False), (3, 17, True)):
        kind = torch.float64 if float_words else torch.int64
        stats, want_stats = torch.zeros(groups.numel() + 1), torch.zeros(groups.numel() + 1)
        got = native.encode(pieces, groups, units, 15, lanes, width, rng, torch.empty_like(
            native.encode(x, groups, units, 15, lanes, width, rng, None, want_stats), dtype=kind), stats)
        want = native.encode(x, groups, units, 15, lanes, width, rng, torch.empty_like(got))
        assert torch.equal(got, want) and torch.equal(stats, want_stats)
    chunk = -(-numel // 3)
    rows = [torch.zeros(3, 4 + 5 * (-(-chunk // 8) + 8), dtype=torch.uint8) for _ in range(2)]
    stats = [torch.zeros(groups.numel() + 1) for _ in range(2)]
    for values, out, local in zip((pieces, x), rows, stats):
        native_planes.encode_planes(values, groups, units, 15, 5, rng, chunk, out, 4, local)
    assert torch.equal(rows[0], rows[1]) and torch.equal(stats[0], stats[1])
    scales = quantizer.local_stats(x, groups)[:-1] * 0.05  # most groups clip
    over = torch.arange(groups.numel()) % 3 != 1  # some are not read
    got, want = (native_excess.clipped_excess(values, groups, scales, over) for values in (pieces, x))
    assert got[0].numel() > 500 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_pieces_that_do_not_fit_are_refused_and_nothing_is_written():
    x = torch.randn(5000)
    pieces, lib = Pieces([x[:3000], x[3000:]]), native.library()
    pointers, _, count, numel, *no_addend = pieces.arguments()
    groups, factors = torch.tensor([5000]), torch.tensor([7.0])
    rng, out = stream_words(0, 0, "pieces"), torch.full((5000 // 10 + 16,), -7, dtype=torch.int64)
    found, indices, excess = torch.full((1,), -7), torch.full((4,), -7), torch.full((4,), -7.0)
    ends = groups.cumsum(0)
    for piece_ends, total in (([3000, 2000], 5000), ([3000, 5000], 5001), ([3000, 4999], 5000), ([-1, 5000], 5000)):
        piece_ends = torch.tensor(piece_ends)
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_encode(pointers, piece_ends.data_ptr(), count, total, *no_addend, ends.data_ptr(),
                               factors.data_ptr(), 1, 15, 10, 6, rng.data_ptr(), 0, 4960, out.data_ptr(), None, 0)
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_clip_excess(pointers, piece_ends.data_ptr(), count, total, *no_addend, ends.data_ptr(),
                                    factors.data_ptr(), torch.ones(1, dtype=torch.uint8).data_ptr(), 1, 4,
                                    indices.data_ptr(), excess.data_ptr(), found.data_ptr())
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_encode_planes(pointers, piece_ends.data_ptr(), count, total, *no_addend, ends.data_ptr(),
                                      factors.data_ptr(), 1, 15, 5, rng.data_ptr(), 2500, 0, 2, 4 + 5 * 320,
                                      out.data_ptr(), None)
    piece_ends = pieces.arguments()[1]
    for places in ([3, 3], [7, 2], [-1, 4], [4, 5000]):  # an addend not strictly ascending within the values
        places, added = torch.tensor(places), torch.ones(2)
        addend = (places.data_ptr(), added.data_ptr(), 2)
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_encode(pointers, piece_ends, count, numel, *addend, ends.data_ptr(), factors.data_ptr(), 1,
                               15, 10, 6, rng.data_ptr(), 0, 4960, out.data_ptr(), None, 0)
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_clip_excess(pointers, piece_ends, count, numel, *addend, ends.data_ptr(), factors.data_ptr(),
                                    torch.ones(1, dtype=torch.uint8).data_ptr(), 1, 4, indices.data_ptr(),
                                    excess.data_ptr(), found.data_ptr())
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_encode_planes(pointers, piece_ends, count, numel, *addend, ends.data_ptr(), factors.data_ptr(),
                                      1, 15, 5, rng.data_ptr(), 2500, 0, 2, 4 + 5 * 320, out.data_ptr(), None)
        with pytest.raises(ValueError, match="ascend strictly"):
            pieces.plus(places, added)
    with pytest.raises(ValueError, match="refused"):  # an addend's count without its places and values
        lib.hvdcomp_encode(pointers, piece_ends, count, numel, 0, 0, 2, ends.data_ptr(), factors.data_ptr(), 1, 15, 10,
                           6, rng.data_ptr(), 0, 4960, out.data_ptr(), None, 0)
    assert bool((out == -7).all()) and int(found) == -7 and bool((indices == -7).all())
    with pytest.raises(ValueError, match="refused"):  # no pieces for values
        lib.hvdcomp_encode(pointers, piece_ends, 0, numel, *no_addend, ends.data_ptr(), factors.data_ptr(), 1, 15,
                           10, 6, rng.data_ptr(), 0, 4960, out.data_ptr(), None, 0)
    for places, added in ((torch.tensor([1, 2]), torch.ones(2, dtype=torch.float64)), (torch.tensor([1, 2]),
                          torch.ones(3)), (torch.tensor([1.0, 2.0]), torch.ones(2))):
        with pytest.raises(ValueError, match="an addend is int64"):
            pieces.plus(places, added)
    summed = pieces.plus(torch.tensor([1, 2]), torch.ones(2))
    with pytest.raises(ValueError, match="an addend already"):
        summed.plus(torch.tensor([3]), torch.ones(1))
    with pytest.raises(ValueError, match="float32 with an addend"):
        summed.fill(torch.empty(5000, dtype=torch.float16))
    for bad in (x.double(), x.view(100, 50).t(), x.half()):
        with pytest.raises(ValueError, match="contiguous float32 CPU"):
            Pieces([x[:10], bad])
    with pytest.raises(ValueError, match="fill"):
        pieces.fill(torch.empty(4999))
    quantizer = MaxNormQuantizer((4, 8))
    with pytest.raises(ValueError, match="one resolution"):
        quantizer.encode(pieces, quantizer.local_stats(x, groups), groups, None, 2, rng=rng)


def _steps(codec_of, use_pieces: bool, sizes: list[int], steps: int = 7):
    """Two workers' scale-ahead exchanges over ``steps`` steps whose gradients grow, shrink and once hold a NaN: each
    step's means and memories, and whether each step left a worker's flat buffer as it was (NaN-filled)."""
    codecs = [codec_of() for _ in range(2)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    gen = torch.Generator().manual_seed(17)
    bases = [[torch.randn(size, generator=gen) for size in sizes] for _ in range(2)]
    seen = []
    for step in range(steps):
        grads = [[g * (1.0 + 0.4 * ((step + r) % 3)) for g in worker] for r, worker in enumerate(bases)]
        if step == 4:
            grads[1][2][5] = float("nan")
        flats = [torch.full((sum(sizes),), float("nan")) for _ in range(2)]
        if use_pieces:
            exchanges = [c.exchange(f, sizes, "k", step, 2, pieces=Pieces(g)) for c, f, g in zip(codecs, flats, grads)]
        else:
            exchanges = [c.exchange(torch.cat(g), sizes, "k", step, 2) for c, g in zip(codecs, grads)]
        means = [mean.clone() for mean in simulate(exchanges)]
        memories = [codec.state_dict()["agreed"] for codec in codecs]
        seen.append((means, memories, [bool(flat.isnan().all()) for flat in flats]))
    return seen


@pytest.mark.parametrize("codec_of", [
    lambda: AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,), chunk_size=5000))),
    lambda: TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "two_stage", scale="ahead"),
], ids=["lanes", "two-stage"])
def test_scale_ahead_exchanges_of_pieces_equal_those_of_the_filled_vector(codec_of):
    sizes = [5000, 0, 70_001, 33, 4096]
    with pytest.warns(RuntimeWarning, match="NaN/Inf at step 4"):
        got, want = _steps(codec_of, True, sizes), _steps(codec_of, False, sizes)
    for (means, memories, _), (want_means, want_memories, _) in zip(got, want):
        assert all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in zip(means, want_means))
        for memory, want_memory in zip(memories, want_memories):
            assert memory["scales"].keys() == want_memory["scales"].keys()
            assert all(torch.equal(memory["scales"][k][2], want_memory["scales"][k][2]) for k in memory["scales"])
            assert memory["excess"].keys() == want_memory["excess"].keys()
            assert all(torch.equal(a, b) for k in memory["excess"]
                       for a, b in zip(memory["excess"][k], want_memory["excess"][k]))
    # exact exchanges (the first, the one after the NaN) and the one seeing the NaN fill the flat buffer; the others,
    # owing an excess or not, read the pieces only
    only_pieces = [[step not in (0, 5) and (step, worker) != (4, 1) for worker in range(2)] for step in range(len(got))]
    assert [untouched for _, _, untouched in got] == only_pieces
    owing = [bool(got[step - 1][1][worker]["excess"]) for step in range(1, len(got)) for worker in range(2)
             if only_pieces[step][worker]]
    assert any(owing) and not all(owing)  # pieces read with an addend, and without
    assert all(mean.isnan().all() for mean in got[4][0])  # the NaN reached every worker


def test_the_exact_scale_takes_no_pieces_and_the_hierarchical_exchange_none():
    codec = TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "two_stage")
    assert not codec.reads_pieces
    pieces = Pieces([torch.ones(8)])
    with pytest.raises(ValueError, match="reads_pieces"):
        next(codec.exchange(torch.empty(8), [8], "k", 0, 2, pieces=pieces))
    fed_back = FP16(error_feedback=True)
    assert not fed_back.reads_pieces
    with pytest.raises(ValueError, match="reads_pieces"):
        next(fed_back.exchange(torch.empty(8), [8], "k", 0, 2, pieces=pieces))
    ahead = AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))))
    for codec, hierarchical in ((ahead, True), (NoCompression(), False)):
        with pytest.raises(ValueError, match="reads_pieces"):
            bucket_exchange(codec, torch.empty(8), [torch.ones(8)], "k", 0, EchoTransport(2), hierarchical,
                            pieces=pieces)


@pytest.mark.parametrize("half", [FP16, BF16])
@pytest.mark.parametrize("natively", [False, True], ids=["all-to-all", "sum"])
def test_16_bit_exchanges_of_pieces_equal_those_of_the_filled_vector(half, natively):
    sizes = [5000, 0, 70_001, 33, 4096]
    codecs = [half() for _ in range(2)]
    assert all(codec.reads_pieces for codec in codecs)
    gen = torch.Generator().manual_seed(19)
    grads = [[torch.randn(size, generator=gen) * 1e3 for size in sizes] for _ in range(2)]
    grads[0][2][7] = 1e6  # beyond float16's range: Inf, as torch rounds it
    results = []
    for use_pieces in (True, False):
        for codec in codecs:
            codec.sums_natively = natively
        flats = [torch.full((sum(sizes),), float("nan")) for _ in range(2)]
        results.append([mean.clone() for mean in simulate([
            c.exchange(f, sizes, "k", 0, 2, pieces=Pieces(g)) if use_pieces else c.exchange(torch.cat(g), sizes, "k",
                                                                                              0, 2)
            for c, f, g in zip(codecs, flats, grads)])])
        assert not use_pieces or all(flat.isnan().all() for flat in flats)  # never filled
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("codec, first_read", [(AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)))), 1),
                                               (FP16(), 0), (MaxNormCodec(MaxNormQuantizer((4,))), None)],
                         ids=["ahead", "fp16", "exact"])
def test_the_runner_hands_gradients_as_pieces_only_to_a_codec_that_reads_them(codec, first_read, monkeypatch):
    reads = first_read is not None
    params = [torch.nn.Parameter(torch.zeros(5000)), torch.nn.Parameter(torch.zeros(300, 7))]
    state = ExchangeState(codec, "test", {})
    state.plan = plan_buckets(params, {params[0]: "a", params[1]: "b"}, 25.0)
    bucket, transport = state.plan[0], EchoTransport(2)
    codec.bind_rank(transport.rank)  # (not the transport: its echo would double the statistics rows in the payload)
    if isinstance(codec, FP16):
        codec.sums_natively = True  # one SUM, which the echo doubles
    runner = Runner(transport, state.stats, "t", state)
    handed = []
    original = Runner._pieces

    def recording(self, codec, grads):
        pieces = original(self, codec, grads)
        if pieces is not None:
            handed.append([t.data_ptr() for t in pieces.tensors])
        return pieces

    monkeypatch.setattr(Runner, "_pieces", recording)
    for step in range(3):  # the exact first exchange, then agreed ones (the same values each step: nothing clips)
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) for p in bucket.params]
        got: dict = {}
        bucket.flat(torch.float32).fill_(float("nan"))
        runner.launch(bucket, grads, lambda _, means, keep, got=got: got.update(means=[m.clone() for m in means]))
        runner.finish()
        assert bool(bucket.flat(torch.float32).isnan().all()) == (reads and step >= first_read), step
        for mean, grad in zip(got["means"], grads):
            assert mean.shape == grad.shape
            assert (mean - grad).abs().max() <= grad.abs().max() / 15 + 1e-6  # one 4-bit level of a twin's own (fp16:
            # its rounding)
    assert len(handed) == (3 if reads else 0) and (not reads or handed[-1] == [g.data_ptr() for g in grads])
    with pytest.MonkeyPatch.context() as patch:  # the kernels off: the flat buffer is filled
        patch.setenv(native.ENV_SWITCH, "0")
        handed.clear()
        runner.launch(bucket, grads, lambda _, means, keep: None)
        runner.finish()
        assert not handed


def test_the_excess_rides_along_with_the_pieces_and_nothing_is_copied():
    memory, flat, pieces = AgreedScales(), torch.full((6,), float("nan")), Pieces([torch.ones(2), torch.ones(4)])
    assert memory.with_excess("k", flat, pieces) is pieces  # nothing owed: the pieces as they are
    memory.keep_excess("k", (torch.tensor([1, 4]), torch.tensor([0.5, -2.0])))
    summed = memory.with_excess("k", flat, pieces)
    assert isinstance(summed, Pieces) and summed.added is not None and pieces.added is None
    assert bool(flat.isnan().all()) and all(bool((t == 1).all()) for t in pieces.tensors)  # nothing written
    assert torch.equal(summed.fill(flat), torch.tensor([1.0, 1.5, 1.0, 1.0, -1.0, 1.0]))
    assert torch.equal(memory.with_excess("k", torch.ones(6)), flat)  # without pieces: the same sum, in a buffer
    state = memory.state_dict()
    descending = (torch.tensor([4, 1]), torch.tensor([0.5, -2.0]))
    for bad in (descending, (torch.tensor([1, 4]), torch.ones(2).double())):
        state["excess"]["k"] = bad
        with pytest.raises(ValueError, match="clipped excess"):
            AgreedScales.check_state(state)


def test_a_tensor_that_is_not_contiguous_is_still_encoded_natively(monkeypatch):
    quantizer, x = MaxNormQuantizer((4,)), _gradient(210_000, 3).view(300, 700).t()
    groups = quantizer.scale_groups(x.numel())
    stats, rng = quantizer.local_stats(x.reshape(-1), groups), stream_words(0, 0, "pieces")
    want = quantizer.encode(x.contiguous(), stats, groups, None, 2, rng=rng)
    calls, kernel = [], native.encode
    monkeypatch.setattr(native, "encode", lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    assert torch.equal(quantizer.encode(x, stats, groups, None, 2, rng=rng), want) and calls == [1]
