"""The float carrier in place: the encode writes its words as float64 exactly (``native.encode`` with a float64
``out``), and ``native_carrier.carrier_sums`` turns reduced float64 words into their int64 sums in the same memory,
equal to torch's rounding bit for bit, on one thread or several, with this CPU's build and the others of
``test_native.BUILDS``; ``carrier.unwrap`` gives the same sums with the kernel or without it, and refuses sums no
carriers make."""

import pytest
import torch
from test_native import SIZES, _gradient, _groups, _native_on, build, other_builds, threads  # noqa: F401 (fixtures)

from hvdcomp.codec import carrier, fused, native, native_carrier
from hvdcomp.codec.pieces import Pieces
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words

# (bits, world size, word bits): the carrier's words for 2, 7 and 4096 workers, and the 52 bits a float64 holds
FLOAT_LAYOUTS = [((4,), 2, carrier.word_bits(2)), ((2,), 7, carrier.word_bits(7)),
                 ((8,), 4096, carrier.word_bits(4096)), ((1,), 3, 52), ((16,), 2, 52)]


@pytest.mark.parametrize("bits,world_size,word_bits", FLOAT_LAYOUTS)
@pytest.mark.parametrize("chunk_size", [1000, None])  # kernel chunks across groups; of one ragged tensor (vector loops)
def test_float_words_are_the_int64_words_exactly(bits, world_size, word_bits, chunk_size, threads, build):  # noqa: F811
    quantizer = MaxNormQuantizer(bits, chunk_size=chunk_size)
    for numel in SIZES:
        x = _gradient(numel, numel + 2)
        groups = _groups(quantizer, numel)
        stats = quantizer.local_stats(x, groups)
        rng = stream_words(7, 0, "rounding", 2, numel)
        want_local = torch.empty_like(stats)
        want = quantizer.encode(x, stats, groups, None, world_size, word_bits, rng, local_out=want_local)
        out, local = torch.full(want.shape, -1.0, dtype=torch.float64), torch.full_like(stats, -1.0)
        assert quantizer.encode(x, stats, groups, None, world_size, word_bits, rng, out, local) is out
        assert torch.equal(out, want.double()) and torch.equal(out.to(torch.int64), want), (numel, bits)
        assert torch.equal(local, want_local)
        if numel == 4099:
            with fused.eager():  # the other paths copy their int64 words into the float64 out
                eager = torch.empty_like(out)
                quantizer.encode(x, stats, groups, None, world_size, word_bits, rng, eager)
            assert torch.equal(eager, out)


def test_float_words_wider_than_52_bits_are_refused():
    quantizer, x = MaxNormQuantizer((4,)), _gradient(4096, 1)
    groups = quantizer.scale_groups(4096)
    stats, rng = quantizer.local_stats(x, groups), stream_words(0, 0, "r", 0, "k")
    words = quantizer.encode(x, stats, groups, None, 2, 63, rng)
    out = torch.full(words.shape, -1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="52-bit"):
        quantizer.encode(x, stats, groups, None, 2, 63, rng, out)
    lib, ends, factors = native.library(), torch.tensor([4096]), quantizer.group_units(stats)
    with pytest.raises(ValueError, match="refused"):  # 12 lanes of 5 bits: 60 bits, each word's float64 not exact
        lib.hvdcomp_encode(*Pieces([x]).arguments(), ends.data_ptr(), factors.data_ptr(), 1, 4, 12, 5, rng.data_ptr(),
                           0, 4096 - 4096 % 192, out.data_ptr(), None, 1)
    assert bool((out == -1.0).all())  # untouched


def _reference(values: torch.Tensor, multiplier: int) -> torch.Tensor:
    """torch's own: round half to even, then int64."""
    return (values * multiplier).round().to(torch.int64)


@pytest.mark.parametrize("multiplier", [1, 2, 3, 4096])
def test_sums_equal_torchs_rounding_in_place(multiplier, threads, build):  # noqa: F811 (the fixtures)
    gen = torch.Generator().manual_seed(multiplier)
    numel = 3 * 2**16 + 7  # a range per thread, then the scalar tail
    sums = torch.randint(0, 2**51 // multiplier, (numel,), generator=gen, dtype=torch.int64)
    noise = (torch.rand(numel, generator=gen, dtype=torch.float64) - 0.5) * 0.5  # rounding error below 1/4
    values = (sums.double() + noise) / multiplier
    values[:6] = torch.tensor([0.5, 1.5, 2.5, -0.25, 2.0**51 - 1, 0.0], dtype=torch.float64) / multiplier  # ties
    buffer = values.clone()
    assert native_carrier.carrier_sums(buffer, multiplier)
    assert torch.equal(buffer.view(torch.int64), _reference(values, multiplier))
    assert buffer.view(torch.int64)[:6].tolist() == [0, 2, 2, 0, 2**51 - 1, 0]


def test_sums_out_of_range_are_flagged_in_any_range(threads, build):  # noqa: F811 (the fixtures)
    numel = 3 * 2**16 + 5
    values = torch.full((numel,), 6.0, dtype=torch.float64)
    for position in (0, numel // 2, numel - 6, numel - 1):  # the first thread's range, a later one's, the tail
        for bad in (float("nan"), float("inf"), -float("inf"), -1.0, -0.51, 2.0**51, 2.0**60, -(2.0**60)):
            buffer = values.clone()
            buffer[position] = bad
            assert not native_carrier.carrier_sums(buffer, 2)
            want = torch.full((numel,), 12, dtype=torch.int64)
            want[position] = 0
            assert torch.equal(buffer.view(torch.int64), want), (position, bad)


@pytest.mark.parametrize("multiplier, first, last", [
    (0.5, 0, 8), (float("nan"), 0, 8), (2.0**33, 0, 8), (1.0, -1, 8), (1.0, 5, 4), (1.0, 0, 9),
])
def test_the_kernel_refuses_what_cannot_be_right(multiplier, first, last):
    values = torch.full((8,), 3.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="refused"):
        native.library().hvdcomp_carrier_sums(values.data_ptr(), 8, multiplier, first, last, None)
    assert bool((values == 3.0).all())  # untouched


def test_the_wrapper_refuses_what_does_not_fit():
    for words, multiplier in [(torch.zeros(8), 1), (torch.zeros(16, dtype=torch.float64)[::2], 1),
                              (torch.zeros(8, dtype=torch.float64), 0), (torch.zeros(8, dtype=torch.float64), 1.5),
                              (torch.zeros(8, dtype=torch.float64), 2**32 + 1)]:
        with pytest.raises(ValueError):
            native_carrier.carrier_sums(words, multiplier)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("op", ["sum", "average"])
def test_unwrap_gives_the_same_sums_in_place_with_the_kernel_or_without(monkeypatch, kernel, op):
    if not kernel:
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    world_size, numel = 3, 5000
    gen = torch.Generator().manual_seed(3)
    words = [torch.randint(0, 2 ** carrier.word_bits(world_size), (numel,), generator=gen) for _ in range(world_size)]
    reduced = sum(carrier.wrap(w, world_size, 99) for w in words)
    if op == "average":
        reduced = reduced / world_size
    sums, averaged = carrier.unwrap(reduced, world_size, 99)
    assert averaged == (op == "average")
    assert sums.dtype == torch.int64 and sums.data_ptr() == reduced[carrier.HEADER:].data_ptr()  # in place
    assert torch.equal(sums, sum(words))
    spoiled = sum(carrier.wrap(w, world_size, 99) for w in words)
    spoiled[carrier.HEADER + numel - 1] = float("nan")
    with pytest.raises(carrier.CarrierMismatchError, match="no sum of carrier words"):
        carrier.unwrap(spoiled, world_size, 99)
