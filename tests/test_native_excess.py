"""The native clipped excess (``hvdcomp.codec.native_excess``): ``AgreedScales.clipped`` gives the same indices and
excess bit for bit with the kernel as without it, for ragged groups, groups of zeros, more clipped elements than the
kernel's first buffer holds, one clipped group among many, with this CPU's build and the others of
``test_native.BUILDS``; a scale-ahead exchange whose gradients change every step returns the same means and keeps the
same excess either way; the kernel refuses groups that do not fit the values."""

import pytest
import torch
from test_native import _native_on, build, other_builds  # noqa: F401 (fixtures)

from hvdcomp.codec import native, native_excess
from hvdcomp.codec.agreed import AgreedScales
from hvdcomp.codec.pieces import Pieces
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import MaxNormCodec, simulate
from hvdcomp.exchange.ahead import AheadMaxNorm


def _torch_clipped(values, local, scale_stats, groups, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv(native.ENV_SWITCH, "0")
        assert not native.usable(values)
        return AgreedScales.clipped(values, local, scale_stats, groups)


def _case(lengths, fraction, seed):
    """Values in ragged groups, each group's scale ``fraction`` of its own maximum (1.0: nothing clips)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), generator=gen) * torch.rand(sum(lengths), generator=gen) ** 3
    values[::5] = 0.0
    groups = torch.tensor(lengths)
    maxima = [part.abs().max() if part.numel() else torch.tensor(0.0) for part in values.split(lengths)]
    local = torch.stack(maxima + [torch.tensor(0.0)])  # local_stats: the groups' maxima, then the NaN/Inf flag
    scale_stats = torch.cat([local[:-1] * torch.tensor(fraction), torch.zeros(1)])
    return values, local, scale_stats, groups


@pytest.mark.usefixtures("build")
@pytest.mark.parametrize("lengths,fraction", [
    ([1000], [0.9]),  # one group
    ([3, 0, 70001, 16, 17, 4099], [0.5, 1.0, 0.999, 0.0, 1.0, 0.7]),  # ragged, an empty group, a scale of 0
    ([300_007], [0.01]),  # most values clip: more than the kernel's first buffer holds
    ([4096] * 40, [1.0] * 39 + [0.8]),  # one clipped group among many, the last
])
def test_native_excess_equals_torchs(lengths, fraction, monkeypatch):
    values, local, scale_stats, groups = _case(lengths, fraction, len(lengths))
    assert native.usable(values)
    indices, excess = AgreedScales.clipped(values, local, scale_stats, groups)
    want_indices, want_excess = _torch_clipped(values, local, scale_stats, groups, monkeypatch)
    assert want_indices.numel() > 0
    assert torch.equal(indices, want_indices) and torch.equal(excess, want_excess)
    if lengths == [300_007]:
        assert indices.numel() > native_excess.FIRST_CAPACITY


def test_only_the_flagged_groups_are_read():
    values, local, scale_stats, groups = _case([100, 100, 100], [0.5, 0.5, 0.5], 3)
    over = torch.tensor([False, True, False])
    indices, _ = native_excess.clipped_excess(values, groups, scale_stats[:-1], over)
    assert indices.numel() and bool(((indices >= 100) & (indices < 200)).all())


def test_the_kernel_refuses_groups_that_do_not_fit():
    values = torch.randn(100)
    lib, limits, check = native.library(), torch.zeros(2), torch.ones(2, dtype=torch.uint8)
    indices, excess, found = torch.full((4,), -7), torch.full((4,), -7.0), torch.full((1,), -7)
    for ends in ([60, 101], [60, 50], [-1, 100]):
        ends = torch.tensor(ends)
        with pytest.raises(ValueError, match="refused"):
            lib.hvdcomp_clip_excess(*Pieces([values]).arguments(), ends.data_ptr(), limits.data_ptr(), check.data_ptr(),
                                    2, 4, indices.data_ptr(), excess.data_ptr(), found.data_ptr())
    assert bool((indices == -7).all()) and bool((excess == -7.0).all()) and int(found) == -7  # untouched
    with pytest.raises(ValueError, match="clipping flags"):
        native_excess.clipped_excess(values, torch.tensor([50, 50]), limits, torch.ones(3, dtype=torch.bool))


def _changing_exchanges(monkeypatch, use_native):
    """Six steps of a two-worker scale-ahead exchange whose gradients grow and shrink: each step's means and each
    worker's excess memory."""
    monkeypatch.setenv(native.ENV_SWITCH, "1" if use_native else "0")
    sizes = [5000, 0, 70001, 33]
    codecs = [AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)))) for _ in range(2)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    gen = torch.Generator().manual_seed(11)
    bases = [torch.randn(sum(sizes), generator=gen) for _ in range(2)]
    seen = []
    for step in range(6):
        grads = [b * (1.0 + 0.3 * ((step + r) % 3)) for r, b in enumerate(bases)]
        means = simulate([c.exchange(g, sizes, "k", step, 2) for c, g in zip(codecs, grads)])
        seen.append((means, [c.memory._excess.get("k") for c in codecs]))
    return seen


def test_a_changing_exchange_is_the_same_with_the_kernel_or_without(monkeypatch):
    with_kernel, without = _changing_exchanges(monkeypatch, True), _changing_exchanges(monkeypatch, False)
    assert any(excess is not None for _, held in with_kernel for excess in held)  # it clipped
    for (means, held), (want_means, want_held) in zip(with_kernel, without):
        assert all(torch.equal(a, b) for a, b in zip(means, want_means))
        for excess, want in zip(held, want_held):
            assert (excess is None) == (want is None)
            if excess is not None:
                assert torch.equal(excess[0], want[0]) and torch.equal(excess[1], want[1])
