"""The native local statistics (``hvdcomp.codec.native_stats``): ``MaxNormQuantizer.local_stats`` gives the same
maxima and NaN/Inf flag bit for bit with the kernel as with torch's per-group and segmented reductions, for per-tensor
and chunked groups, zeros and negative zeros, NaN and infinities, a given ``finite``, one thread or several, with this
CPU's build and the others of ``test_native.BUILDS``; so does the two-stage encode's pass (``native_planes``); an
exact exchange gives the same means either way; the kernel refuses groups that do not fit the values and leaves its
output untouched."""

import pytest
import torch
from test_native import _native_on, build, other_builds, threads  # noqa: F401 (fixtures)

from hvdcomp.codec import native, native_planes, native_stats
from hvdcomp.codec.packing import plane_bytes
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import MaxNormCodec, simulate


def _torch_stats(quantizer, x, groups, monkeypatch, finite=None):
    with monkeypatch.context() as patch:
        patch.setenv(native.ENV_SWITCH, "0")
        assert not native.usable(x)
        return quantizer.local_stats(x, groups, finite)


def _values(numel, seed, specials):
    """Values over many magnitudes with exact and negative zeros, and ``specials`` (NaN, +-Inf) at a few places
    (none in fewer than 100 values)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 4
    x[::9] = 0.0
    x[4::13] = -0.0
    for offset, value in zip((numel // 3, numel // 2 + 5, numel - 1), specials if numel >= 100 else ()):
        x[offset] = value
    return x


@pytest.mark.usefixtures("build", "threads")
@pytest.mark.parametrize("lengths,chunk_size", [
    ([2], None),  # two values (the first 0.0; no NaN or Inf)
    ([3, 70001, 16, 17, 4099, 300_007], None),  # per tensor: ragged, off the vector width
    ([70001, 4099, 131_072 + 3], 1000),  # chunks: many short groups (the segmented reduction)
    ([8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8], None),  # more groups than the per-group loop takes
])
@pytest.mark.parametrize("specials", [(), (float("nan"),), (float("inf"), float("-inf"), float("nan"))])
def test_native_stats_equal_torchs(lengths, chunk_size, specials, monkeypatch):
    quantizer = MaxNormQuantizer((4,), chunk_size)
    x = _values(sum(lengths), len(lengths), specials)
    groups = quantizer.scale_groups(x.numel(), lengths)
    assert native.usable(x)
    stats = quantizer.local_stats(x, groups)
    want = _torch_stats(quantizer, x, groups, monkeypatch)
    assert torch.equal(stats, want) and torch.equal(stats.view(torch.int32), want.view(torch.int32))  # +0.0, not -0.0
    assert float(stats[-1]) == float(bool(specials) and x.numel() >= 100) and float(stats[:-1].max()) > 0
    for finite in (torch.tensor(True), torch.tensor(False)):  # sparse.gather's flag replaces the values' own
        assert torch.equal(quantizer.local_stats(x, groups, finite),
                           _torch_stats(quantizer, x, groups, monkeypatch, finite))


@pytest.mark.usefixtures("build", "threads")
@pytest.mark.parametrize("specials", [(), (float("nan"), float("-inf"))])
def test_the_two_stage_encode_finds_them_in_its_pass(specials, monkeypatch):
    quantizer, lengths, world_size, width = MaxNormQuantizer((4,), 5000), [70001, 17, 131_072 + 3], 3, 5
    x = _values(sum(lengths), 7, specials)
    groups = quantizer.scale_groups(x.numel(), lengths)
    want = _torch_stats(quantizer, x, groups, monkeypatch)
    chunk = -(-x.numel() // world_size)
    planes = torch.zeros(world_size, 4 + plane_bytes(chunk, width), dtype=torch.uint8)
    rng, units = torch.tensor([1, 2, 3, 4]), torch.full((groups.numel(),), 3.0)
    without = native_planes.encode_planes(x, groups, units, 15, width, rng, chunk, planes.clone(), 4)
    stats = torch.full_like(want, -1.0)  # overwritten, not raised to
    with_stats = native_planes.encode_planes(x, groups, units, 15, width, rng, chunk, planes, 4, stats)
    assert torch.equal(stats, want) and torch.equal(with_stats, without)


def test_groups_of_zeros_and_without_values():
    x = torch.tensor([0.0, -0.0, 2.0, -3.0, float("inf")])
    stats = native_stats.local_stats(x, torch.tensor([2, 0, 2, 1]))
    assert stats.tolist() == [0.0, 0.0, 3.0, 0.0, 1.0] and not bool(stats.signbit().any())


def test_the_kernel_refuses_groups_that_do_not_fit():
    x = torch.randn(100)
    lib, stats = native.library(), torch.full((3,), -7.0)
    for ends, first, last in (([60, 101], 0, 100), ([60, 50], 0, 100), ([-1, 100], 0, 100), ([60, 100], 0, 101),
                              ([60, 100], 50, 40)):
        ends = torch.tensor(ends)
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_local_stats(x.data_ptr(), 100, ends.data_ptr(), 2, first, last, stats.data_ptr())
    assert bool((stats == -7.0).all())  # untouched
    with pytest.raises(ValueError, match="float32"):
        native_stats.local_stats(x.double(), torch.tensor([100]))
    with pytest.raises(ValueError):
        native_stats.local_stats(x, torch.tensor([50, 49]))


@pytest.mark.parametrize("chunk_size", [None, 777])
def test_an_exact_exchange_gives_the_same_means_with_and_without_the_kernel(chunk_size, monkeypatch):
    sizes = [5000, 70001, 33]
    grads = [_values(sum(sizes), rank, ()) for rank in range(3)]

    def means(use_native):
        monkeypatch.setenv(native.ENV_SWITCH, "1" if use_native else "0")
        codecs = [MaxNormCodec(MaxNormQuantizer((4,), chunk_size), seed=3) for _ in grads]
        for rank, codec in enumerate(codecs):
            codec.bind_rank(rank)
        return simulate([c.exchange(g, sizes, "b", 2, len(grads)) for c, g in zip(codecs, grads)])

    for natively, eagerly in zip(means(True), means(False)):
        assert torch.equal(natively, eagerly)
